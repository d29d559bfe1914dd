"""Measured costs: calibrate a cluster profile on this machine, validate the cost model.

- :func:`tensoropt.calibrate.profile.calibrate` measures per-op-family compute rates
  (forward kernels and whole training steps of one op) through onnxruntime and the
  alpha-beta rates of the runtime's collectives, and returns a cluster JSON object
  that :func:`tensoropt.cost.cluster.from_json` reads (``tensoropt calibrate``).
- :mod:`tensoropt.calibrate.validate` compares estimated with measured step time
  and memory of searched plans (``tensoropt validate``).

See docs/design/measured.md.
"""
