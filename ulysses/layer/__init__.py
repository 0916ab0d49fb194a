"""The layer's parts behind ``ulysses_attention``: :mod:`.default` (which attention
``attn=None`` runs for a call's signature)."""
