"""Programs that run under torchrun and check ``ulysses`` across a real process group (SPEC §5).

``python -m torch.distributed.run --standalone --nproc-per-node P -m dist_tests.harness``
"""
