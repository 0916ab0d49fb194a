"""The layer behind ``ulysses_attention``, in three parts with one interface each:

* :mod:`.exchange`: sequence shards to head shards and back, forward and backward (bf16,
  lowp values or codes, uneven heads), one chunk or n;
* :mod:`.attend`: the registry of attentions (sdpa, documents, flex, masked, a user's
  callable, the codes), each with what it supports, its forward and its backward;
* the schedule, ``ulysses.overlap.Layer``: one autograd Function running exchange -> attend
  -> exchange over n head chunks.

:mod:`.plan` resolves a call's exchange, attention and chunk count once per signature;
:mod:`.default` is the table behind ``attn=None``'s choice of the codes.
"""
