"""Measurements, each beside its peers: `harness` and `worker` (`aotbuild bench`: cases in fresh
processes), `component` (one component against the peers in one process), `peers` (OpenVINO,
ONNX Runtime), `growth` (cost against work), `load` (a load bench of a running server),
`replicas` (replica cold start), `stats` (medians, paired ratios, percentiles) and `report` (the
JSON documents, one table formatter, plots). Nothing below imports from here."""
