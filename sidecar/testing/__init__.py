"""Stand-ins for what cannot exist on a development machine: NVML (`fake_nvml_lib.py`, a fake
libnvidia-ml under the real pynvml; `fake_nvml.py`, a pynvml-like module; both answer from the
driver model in `nvml_model.py`) and Grafana's HTTP API (`fake_grafana.py`).

Imports nothing of the sidecar's rooms, and no room imports it: a daemon reaches the NVML
stand-ins only by name, through the `collectors.nvml_module` setting; the tests, benchmarks and
demo import them directly.
"""
