"""`sidecar preflight`: every check reports on this GPU-less machine, peers' version skew
fails naming the field, and the individual judgements (GPU health, Xids, shared storage,
rendezvous, strictness) on controlled inputs."""

from __future__ import annotations

import json
import socket

import pytest

from sidecar.config import load_settings
from sidecar.preflight import gpu_checks, node_checks, peers
from sidecar.preflight.results import Context, Result, exit_code
from sidecar.testing import fake_nvml, fake_nvml_lib
from tests.ops.helpers import Rank, preflight_args, run_cli
from tests.support import Sidecar, free_port, wait_until

CHECKS = [
    "nvidia-driver",
    "gpu-count",
    "gpu-health",
    "xid",
    "torch",
    "nics",
    "infiniband",
    "rendezvous",
    "shared-storage",
    "checkpoint-disk",
    "clock",
    "sidecar",
    "version-skew",
]


def _run(check, settings=None, **over) -> list[Result]:
    return list(check(Context(preflight_args(**over), settings or load_settings(environ={}))))


def test_every_check_runs_and_reports_without_a_gpu(tmp_path):
    out = run_cli(
        "preflight",
        "--json",
        "--shared-dir",
        str(tmp_path),
        "--checkpoint-dir",
        str(tmp_path),
        "--min-free-gb",
        "0",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
    )
    doc = json.loads(out.stdout)
    by_check = {}
    for r in doc["results"]:
        by_check.setdefault(r["check"], []).append(r)
    assert [c for c in CHECKS if c not in by_check] == []
    driver = by_check["nvidia-driver"][0]
    assert driver["outcome"] == "WARN" and "no NVIDIA driver" in driver["detail"]
    assert by_check["torch"][0]["outcome"] == "PASS" and "2.13" in by_check["torch"][0]["detail"]
    assert not any("crashed" in r["detail"] for r in doc["results"])
    failed = [r for r in doc["results"] if r["outcome"] == "FAIL"]
    assert out.returncode == doc["exit_code"] == (1 if failed else 0), failed


def test_with_no_checkpoint_dir_the_checkpoint_disk_check_is_skipped():
    (result,) = _run(node_checks.check_checkpoint_disk, load_settings(overrides={"checkpoint_dir": ""}, environ={}))
    assert (result.outcome, result.detail) == (
        "SKIP",
        "no checkpoint directory (--checkpoint-dir, or the checkpoint_dir setting)",
    )


def test_plain_output_is_one_line_per_check_with_hints(tmp_path):
    out = run_cli("preflight", "--checkpoint-dir", str(tmp_path), "--min-free-gb", "1e9")
    assert out.returncode == 1
    assert "\x1b[" not in out.stdout
    line = next(line for line in out.stdout.splitlines() if " checkpoint-disk " in line)
    assert line.startswith("FAIL") and "below 1e+09 GB" in line
    assert "hint:" in out.stdout
    assert out.stdout.splitlines()[-1].endswith("-> exit 1")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two live sidecars whose ranks run different torch versions."""
    nodes, made = [], []
    try:
        for name, torch in (("a", "2.13.0"), ("b", "2.12.1")):
            sidecar = Sidecar(tmp_path_factory.mktemp(f"node-{name}"), "watchdog.observe_only=true").start()
            nodes.append(sidecar)
            made.append(Rank(sidecar, "run-9", 0, {"torch": torch, "nccl": "2.27.3", "python": "3.11.7"}))
        for sidecar in nodes:
            wait_until(lambda s=sidecar: 'torch_version="2.1' in s.metrics(), 30, what="versions exported")
        yield nodes
    finally:
        for r in made:
            r.close()
        for sidecar in nodes:
            sidecar.stop()


def test_peers_with_different_torch_fail_naming_field_values_and_nodes(two_nodes):
    a, b = two_nodes
    out = run_cli("preflight", "--json", "--peers", f"{a.url},{b.url}")
    assert out.returncode == 1
    skew = [r for r in json.loads(out.stdout)["results"] if r["check"] == "version-skew"]
    assert [r["outcome"] for r in skew] == ["FAIL"], skew
    detail = skew[0]["detail"]
    assert detail.startswith("torch_version differs:")
    assert f"2.12.1 on {socket.gethostname()} ({b.url})" in detail
    assert f"2.13.0 on {socket.gethostname()} ({a.url})" in detail


def test_peers_that_agree_pass(two_nodes):
    a, _ = two_nodes
    results = _run(peers.check_peers, peers=f"{a.url},{a.url}/")
    assert [r.outcome for r in results] == ["PASS"], results


def test_an_unreachable_peer_fails_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    results = _run(peers.check_peers, peers=url)
    assert results[0].outcome == "FAIL" and url in results[0].detail


def test_the_local_sidecar_passes_when_healthy_and_warns_when_absent(two_nodes, tmp_path):
    healthy = _run(node_checks.check_sidecar, socket=two_nodes[0].socket)[0]
    assert healthy.outcome == "PASS" and two_nodes[0].socket in healthy.detail
    absent = _run(node_checks.check_sidecar, socket=str(tmp_path / "none.sock"))[0]
    assert absent.outcome == "WARN" and "without metrics or the watchdog" in absent.detail


def test_compare_versions_ignores_fields_a_node_does_not_report():
    nodes = {"a": {"driver_version": {"550.54"}, "os": {"Ubuntu 22.04"}}, "b": {"driver_version": {"550.54"}}}
    assert peers.compare_versions(nodes) == []


def test_kernel_and_os_skew_only_warns():
    nodes = {"a": {"kernel": {"6.1"}}, "b": {"kernel": {"6.8"}}}
    (result,) = peers.compare_versions(nodes)
    assert result.outcome == "WARN" and "kernel differs: 6.1 on a; 6.8 on b" in result.detail


@pytest.fixture
def nvml_stand_in():
    """The real pynvml over a fake libnvidia-ml (configure it with fake_nvml.configure)."""
    fake_nvml_lib.install()
    yield load_settings(overrides={"collectors.nvml_module": "sidecar.testing.fake_nvml_lib"}, environ={})
    fake_nvml_lib.uninstall()
    fake_nvml.configure(None)


def test_gpu_checks_fail_on_a_lost_gpu_and_a_pending_remap(nvml_stand_in):
    fake_nvml.configure(
        {
            "driver_version": "550.54.15",
            "cuda_driver_version": 12040,
            "gpu_count": 3,
            "gpus": {"1": {"remapped_rows": [0, 1, 1, 0]}, "2": {"errors": {"*": "gpu_is_lost"}}},
        }
    )
    health = _run(gpu_checks.check_gpu_health, nvml_stand_in)
    assert [r.outcome for r in health] == ["FAIL", "FAIL"], health
    assert health[0].detail.startswith("GPU 2 cannot be read")
    assert health[1].detail.startswith("GPU 1 (") and "row remap pending" in health[1].detail
    count = _run(gpu_checks.check_gpu_count, nvml_stand_in, expect_gpus=8)
    assert count[0].outcome == "FAIL" and "3 GPUs visible, expected 8" in count[0].detail
    driver = _run(gpu_checks.check_driver, nvml_stand_in)
    assert driver[0].outcome == "PASS" and "550.54.15" in driver[0].detail and "CUDA 12.4" in driver[0].detail


def test_healthy_gpus_pass(nvml_stand_in):
    fake_nvml.configure({"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpu_count": 2})
    assert [r.outcome for r in _run(gpu_checks.check_gpu_health, nvml_stand_in)] == ["PASS"]
    assert [r.outcome for r in _run(gpu_checks.check_gpu_count, nvml_stand_in, expect_gpus=2)] == ["PASS"]


def test_a_mig_gpu_does_not_pass_health_it_could_not_read(nvml_stand_in):
    fake_nvml.configure({"gpu_count": 2, "gpus": {"1": {"mig_mode": [1, 1]}}})
    health = _run(gpu_checks.check_gpu_health, nvml_stand_in)
    assert [r.outcome for r in health] == ["WARN", "PASS"], health
    assert health[0].detail.startswith("GPU 1 (") and "could not check pending row remaps" in health[0].detail
    assert "remapped_rows: not_supported" in health[0].detail and "MIG mode is on" in health[0].detail
    assert health[1].detail.startswith("1 GPUs:")


@pytest.mark.parametrize("error", ["no_permission", "unknown"])
def test_health_fields_that_fail_to_read_are_not_passed(nvml_stand_in, error):
    fake_nvml.configure(
        {
            "gpu_count": 1,
            "gpu": {
                "errors": {
                    "nvmlDeviceGetRemappedRows": error,
                    "nvmlDeviceGetRetiredPagesPendingStatus": error,
                    "nvmlDeviceGetTotalEccErrors": error,
                }
            },
        }
    )
    health = _run(gpu_checks.check_gpu_health, nvml_stand_in)
    assert [r.outcome for r in health] == ["WARN"], health
    assert f"remapped_rows: {error}" in health[0].detail and f"ecc_uncorrected: {error}" in health[0].detail


def test_an_r470_driver_is_checked_not_crashed(nvml_stand_in):
    fake_nvml.configure({"gpu_count": 2, "driver_generation": "r470"})
    assert [r.outcome for r in _run(gpu_checks.check_gpu_health, nvml_stand_in)] == ["PASS"]
    assert [r.outcome for r in _run(gpu_checks.check_gpu_count, nvml_stand_in, expect_gpus=2)] == ["PASS"]


@pytest.mark.parametrize(
    "init_error, outcome", [("driver_not_loaded", "WARN"), ("unknown", "FAIL"), ("lib_rm_version_mismatch", "FAIL")]
)
def test_no_driver_warns_but_a_failing_driver_fails(nvml_stand_in, init_error, outcome):
    fake_nvml.configure({"init_error": init_error})
    (result,) = _run(gpu_checks.check_driver, nvml_stand_in)
    assert result.outcome == outcome, result


def _pci_tree(root, *devices: tuple[str, str, str, str | None]) -> str:
    """A sysfs tree with PCI devices (address, vendor, class, bound driver or None)."""
    for address, vendor, pci_class, driver in devices:
        device = root / "bus/pci/devices" / address
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
        if driver:
            (root / "bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
            (device / "driver").symlink_to(root / "bus/pci/drivers" / driver)
    return str(root)


H100 = ("0000:3b:00.0", "0x10de", "0x030200", None)  # a 3D controller without its driver
NVSWITCH = ("0000:05:00.0", "0x10de", "0x068000", None)  # NVIDIA, but a bridge
CONNECTX = ("0000:1a:00.0", "0x15b3", "0x020700", "mlx5_core")
VM_GPU = ("0000:4c:00.0", "0x10de", "0x030200", "vfio-pci")  # handed to a virtual machine


@pytest.mark.parametrize(
    "devices, outcome",
    [
        ([H100, CONNECTX], "FAIL"),
        ([("0000:3b:00.0", "0x10de", "0x030000", "nouveau")], "FAIL"),  # a VGA controller on nouveau
        ([NVSWITCH, CONNECTX], "WARN"),
        ([VM_GPU], "WARN"),
        ([], "WARN"),
    ],
    ids=["gpu-no-driver", "gpu-on-nouveau", "nvswitch-and-nic", "gpu-passed-to-a-vm", "no-pci-devices"],
)
def test_no_driver_fails_where_nvidia_gpus_are_on_the_pci_bus(nvml_stand_in, tmp_path, devices, outcome):
    fake_nvml.configure({"init_error": "driver_not_loaded"})
    settings = load_settings(
        overrides={
            "collectors.nvml_module": "sidecar.testing.fake_nvml_lib",
            "collectors.sysfs_root": _pci_tree(tmp_path, *devices),
        },
        environ={},
    )
    (result,) = _run(gpu_checks.check_driver, settings)
    assert result.outcome == outcome, result
    if outcome == "FAIL":
        assert "1 NVIDIA GPUs on the PCI bus (0000:3b:00.0" in result.detail and "no NVIDIA driver" in result.detail


def test_preflight_fails_a_node_whose_gpus_have_no_driver_without_expect_gpus(tmp_path):
    """The command as a launcher runs it, on this machine (no NVML) with a sysfs tree that has GPUs."""
    tree = _pci_tree(tmp_path / "sys", H100, ("0000:3c:00.0", "0x10de", "0x030200", None))
    out = run_cli(
        "preflight",
        "--json",
        "--set",
        f"collectors.sysfs_root={tree}",
        "--checkpoint-dir",
        str(tmp_path),
        "--min-free-gb",
        "0",
        "--kernel-log",
        str(tmp_path / "kern.log"),
    )
    doc = json.loads(out.stdout)
    failed = {r["check"]: r for r in doc["results"] if r["outcome"] == "FAIL"}
    assert list(failed) == ["nvidia-driver"], failed
    assert "2 NVIDIA GPUs on the PCI bus" in failed["nvidia-driver"]["detail"]
    assert out.returncode == doc["exit_code"] == 1


def _interpreter(tmp_path, **facts) -> str:
    """A stand-in for the training environment's python that answers the torch probe."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho '{json.dumps(facts)}'\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "driver_cuda, torch_cuda, available, outcome",
    [
        (12040, "12.4", True, "PASS"),
        (12040, "12.8", True, "WARN"),  # minor version compatibility
        (11080, "12.4", True, "FAIL"),  # a newer major version than the driver knows
        (12040, "12.4", False, "FAIL"),  # cannot see the GPUs
        (12040, None, False, "FAIL"),  # a CPU build on a GPU node
    ],
)
def test_torch_cuda_against_the_driver(nvml_stand_in, tmp_path, driver_cuda, torch_cuda, available, outcome):
    fake_nvml.configure({"driver_version": "550.54.15", "cuda_driver_version": driver_cuda, "gpu_count": 2})
    python = _interpreter(
        tmp_path,
        torch="2.7.0",
        cuda=torch_cuda,
        nccl="2.26.2" if torch_cuda else None,
        cuda_available=available,
        device_count=2 if available else 0,
    )
    torch, *cuda = _run(gpu_checks.check_torch, nvml_stand_in, python=python)
    assert torch.outcome == "PASS" and "torch 2.7.0" in torch.detail
    assert [r.outcome for r in cuda] == [outcome], cuda


def test_expecting_gpus_without_a_driver_fails():
    results = _run(gpu_checks.check_gpu_count, expect_gpus=8)
    assert results[0].outcome == "FAIL"


KERNEL_LOG = """\
[  12.3] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15
[ 812.1] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics SM Warp Exception
[ 813.9] NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics SM Warp Exception
"""


def test_application_xids_warn_and_strict_turns_that_into_failure(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(KERNEL_LOG)
    results = _run(gpu_checks.check_xids, kernel_log=str(log))
    assert [r.outcome for r in results] == ["WARN"]
    assert "Xid 13 on 0000:3b:00 x2" in results[0].detail
    assert exit_code(results, strict=False) == 0
    assert exit_code(results, strict=True) == 1


def test_a_hardware_xid_fails(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(
        KERNEL_LOG + "[ 900.0] NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', GPU has fallen off the bus.\n"
    )
    results = _run(gpu_checks.check_xids, kernel_log=str(log))
    assert results[0].outcome == "FAIL" and "Xid 79 on 0000:86:00 x1 (GPU has fallen off the bus)" in results[0].detail


def test_an_unreadable_kernel_log_warns(tmp_path):
    results = _run(gpu_checks.check_xids, kernel_log=str(tmp_path / "absent.log"))
    assert results[0].outcome == "WARN" and "kernel log not readable" in results[0].detail


def test_shared_marker_written_on_one_node_is_found_on_another(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    wrote = _run(node_checks.check_shared_dir, shared_dir=str(shared), shared_marker="write:job-17")
    assert wrote[-1].check == "shared-marker" and wrote[-1].outcome == "PASS"
    found = _run(node_checks.check_shared_dir, shared_dir=str(shared), shared_marker="check:job-17")
    assert found[-1].outcome == "PASS" and socket.gethostname() in found[-1].detail


def test_shared_marker_missing_or_different_fails(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _run(node_checks.check_shared_dir, shared_dir=str(tmp_path / "a"), shared_marker="write:job-17")
    other_token = _run(node_checks.check_shared_dir, shared_dir=str(tmp_path / "a"), shared_marker="check:job-18")
    assert other_token[-1].outcome == "FAIL" and "'job-17', not 'job-18'" in other_token[-1].detail
    elsewhere = _run(node_checks.check_shared_dir, shared_dir=str(tmp_path / "b"), shared_marker="check:job-17")
    assert elsewhere[-1].outcome == "FAIL" and "no marker" in elsewhere[-1].detail


def test_a_missing_shared_dir_fails(tmp_path):
    results = _run(node_checks.check_shared_dir, shared_dir=str(tmp_path / "not-mounted"))
    assert results[0].outcome == "FAIL"


def test_rendezvous_listening_passes_and_a_taken_local_port_fails():
    with socket.create_server(("127.0.0.1", 0)) as server:
        endpoint = f"127.0.0.1:{server.getsockname()[1]}"
        assert _run(node_checks.check_rendezvous, rdzv_endpoint=endpoint)[0].outcome == "PASS"
    free = f"127.0.0.1:{free_port()}"
    result = _run(node_checks.check_rendezvous, rdzv_endpoint=free)[0]
    assert result.outcome == "PASS" and "will host the c10d store" in result.detail
    with socket.socket() as taken:  # bound, not listening: connect is refused, bind fails
        taken.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{taken.getsockname()[1]}"
        assert _run(node_checks.check_rendezvous, rdzv_endpoint=endpoint)[0].outcome == "FAIL"


def test_a_malformed_rendezvous_endpoint_fails_naming_it():
    result = _run(node_checks.check_rendezvous, rdzv_endpoint="node-0")[0]
    assert result.outcome == "FAIL" and "--rdzv-endpoint" in result.detail


def test_torch_absent_from_the_interpreter_warns(tmp_path):
    results = _run(gpu_checks.check_torch, python="/bin/false")
    assert results[0].outcome == "WARN" and "torch not importable" in results[0].detail


def test_nic_and_infiniband_links_from_a_sysfs_tree(tmp_path):
    for dev, state in (("eth0", "up"), ("eth1", "down")):
        (tmp_path / "class/net" / dev).mkdir(parents=True)
        (tmp_path / "class/net" / dev / "operstate").write_text(state + "\n")
    port = tmp_path / "class/infiniband/mlx5_0/ports/1"
    port.mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    settings = load_settings(overrides={"collectors.sysfs_root": str(tmp_path)}, environ={})
    nics = _run(node_checks.check_nics, settings)[0]
    assert nics.outcome == "WARN" and "eth1" in nics.hint and "eth0 up" in nics.detail
    ib = _run(node_checks.check_infiniband, settings)[0]
    assert ib.outcome == "WARN" and "mlx5_0/1 DOWN 200 Gb/s" in ib.detail
