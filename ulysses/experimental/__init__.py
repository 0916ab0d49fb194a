"""Code apart from the layer's import path: ``ulysses`` never imports this package.

lowp_attention   a Triton attention kernel that reads the INT8/FP8 codes and scales of
                 ``LowpQKV`` directly (pointer and TMA variants, its own autotuner);
                 measured against cuDNN SDPA on the dequantized values by
                 ``scripts/bench_step.py --codes`` (docs/BENCHMARKS.md). The layer keeps
                 SDPA, which was faster or equal at every measured shape.
"""
