"""tensoropt: plan, partition and run distributed DNN training over ONNX.

After Cai et al., "TensorOpt: Exploring the Tradeoffs in Distributed DNN Training
With Auto-Parallelism" (IEEE TPDS 2022). See docs/design.md for the architecture.
"""

__version__ = "0.1.0"
