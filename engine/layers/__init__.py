"""The model's building blocks: linear forms, norms, activations, rotary, attention backends.

Each module's implementation is fixed when it is built or when the weights are loaded, never
re-decided per forward. The per-layer modules alias `__call__` to `forward`: nn.Module's call
goes through its hook dispatch (~1.3 µs), and a decode step of a 30-layer model makes ~330 such
calls (0.45 ms, about 5% of a batch-1 step of the default model on 2 cores). Nothing registers
hooks on these modules; the model itself keeps the ordinary call.
"""
