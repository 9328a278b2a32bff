"""The NIC collector against a fixture sysfs tree: Ethernet interfaces (eth0 up, eth1 down,
ens1f0np0, ib0; lo and a veth excluded) and InfiniBand ports (mlx5_0 port 1 active, mlx5_1 down)."""

from __future__ import annotations

import os
import shutil

import pytest

from sidecar.collectors import sysfs
from sidecar.collectors.nic import NicCollector
from sidecar.config import CollectorSettings
from tests.collectors.helpers import FIXTURE_SYSFS, by_label, exposition, run, series

DEFAULT_EXCLUDE = CollectorSettings().nic_exclude


def collect(root=FIXTURE_SYSFS, exclude=DEFAULT_EXCLUDE, max_nics=64):
    result = run(NicCollector(root, exclude, max_nics))
    assert result.success, result.error
    return result.families


def test_virtual_interfaces_are_excluded_by_default():
    nics = by_label(collect(), "sidecar_network_receive_bytes_total", "device")
    assert set(nics) == {"eth0", "eth1", "ens1f0np0", "ib0"}


def test_counters_come_from_statistics():
    families = collect()
    assert by_label(families, "sidecar_network_receive_bytes_total", "device")["eth0"] == 1_000_000
    assert by_label(families, "sidecar_network_transmit_bytes_total", "device")["eth0"] == 875_000
    assert by_label(families, "sidecar_network_receive_errs_total", "device")["eth0"] == 4
    assert by_label(families, "sidecar_network_transmit_drop_total", "device")["eth0"] == 7
    assert by_label(families, "sidecar_network_carrier_changes_total", "device")["eth1"] == 7


def test_a_down_interface_is_not_up_and_has_no_speed():
    families = collect()
    up = by_label(families, "sidecar_network_up", "device")
    assert up["eth1"] == 0 and up["eth0"] == 1
    assert "eth1" not in by_label(families, "sidecar_network_speed_bytes", "device")


def test_speed_is_in_bytes_per_second():
    speed = by_label(collect(), "sidecar_network_speed_bytes", "device")
    assert speed["eth0"] == 25_000 * 1e6 / 8
    assert speed["ens1f0np0"] == 100_000 * 1e6 / 8


def test_max_nics_bounds_the_interfaces():
    assert len(by_label(collect(max_nics=2), "sidecar_network_up", "device")) == 2


def test_infiniband_ports_report_state_rate_and_data_in_bytes():
    families = collect()
    key = (("device", "mlx5_0"), ("port", "1"))
    assert series(families, "sidecar_infiniband_port_up")[key] == 1
    assert series(families, "sidecar_infiniband_port_state_id")[key] == 4
    assert series(families, "sidecar_infiniband_port_physical_state_id")[key] == 5
    assert series(families, "sidecar_infiniband_rate_bytes_per_second")[key] == 25e9
    assert series(families, "sidecar_infiniband_port_data_received_bytes_total")[key] == 4000
    assert series(families, "sidecar_infiniband_port_data_transmitted_bytes_total")[key] == 10_000
    assert series(families, "sidecar_infiniband_link_downed_total")[key] == 1
    assert series(families, "sidecar_infiniband_port_transmit_wait_total")[key] == 777


def test_a_down_infiniband_port_is_not_up():
    families = collect()
    key = (("device", "mlx5_1"), ("port", "1"))
    assert series(families, "sidecar_infiniband_port_up")[key] == 0
    assert series(families, "sidecar_infiniband_port_state_id")[key] == 1
    info = series(families, "sidecar_infiniband_port_info")
    assert dict(next(k for k in info if dict(k)["device"] == "mlx5_1"))["state"] == "down"


def test_a_node_without_infiniband_has_no_infiniband_series(tmp_path):
    shutil.copytree(FIXTURE_SYSFS / "class" / "net", tmp_path / "class" / "net")
    families = collect(tmp_path)
    assert not [f for f in families if f.name.startswith("sidecar_infiniband")]
    assert by_label(families, "sidecar_network_up", "device")


def test_a_missing_sysfs_yields_no_series_and_no_failure(tmp_path):
    assert collect(tmp_path / "nothing-here") == []


def test_an_interface_missing_files_exports_what_it_has(tmp_path):
    shutil.copytree(FIXTURE_SYSFS / "class" / "net" / "eth0", tmp_path / "class" / "net" / "eth9")
    (tmp_path / "class" / "net" / "eth9" / "speed").unlink()
    (tmp_path / "class" / "net" / "eth9" / "statistics" / "rx_bytes").unlink()
    families = collect(tmp_path)
    assert "eth9" not in by_label(families, "sidecar_network_speed_bytes", "device")
    assert "eth9" not in by_label(families, "sidecar_network_receive_bytes_total", "device")
    assert by_label(families, "sidecar_network_transmit_bytes_total", "device")["eth9"] == 875_000


def test_a_garbled_counter_is_a_partial_failure(tmp_path):
    shutil.copytree(FIXTURE_SYSFS / "class" / "net" / "eth0", tmp_path / "class" / "net" / "eth0")
    (tmp_path / "class" / "net" / "eth0" / "statistics" / "rx_bytes").write_text("garbage\n")
    result = run(NicCollector(tmp_path, DEFAULT_EXCLUDE, 64))
    assert not result.success and "rx_bytes" in result.error
    assert by_label(result.families, "sidecar_network_transmit_bytes_total", "device") == {"eth0": 875_000}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("200 Gb/sec (4X HDR)", 25e9),
        ("100 Gb/sec (2X HDR)", 12.5e9),
        ("2.5 Gb/sec (1X SDR)", 312.5e6),
        ("400 Gb/sec (4X NDR)", 50e9),
        ("", None),
        ("weird", None),
    ],
)
def test_infiniband_rates_are_parsed(text, expected):
    assert sysfs.parse_rate(text) == expected


def test_the_readers_return_typed_records_with_absent_files_as_none(tmp_path):
    (tmp_path / "class" / "net" / "x0").mkdir(parents=True)
    record = sysfs.read_net_device(tmp_path, "x0")
    assert record.device == "x0" and record.rx_bytes is None and record.operstate is None and not record.problems


GOLDEN = FIXTURE_SYSFS.parent / "nic.prom"


def test_the_exposition_matches_the_golden_file():
    """The whole NIC exposition for the fixture tree. After an intended change, regenerate with
    SIDECAR_UPDATE_GOLDEN=1 pytest tests/collectors/test_nic.py and review the diff."""
    text = exposition(collect())
    if os.environ.get("SIDECAR_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "the NIC exposition changed; see this test's docstring"


def test_a_stuck_collectives_record_gets_the_links_errors_and_waits():
    from sidecar.collectors.nic import link_facts

    facts = link_facts(NicCollector(FIXTURE_SYSFS, DEFAULT_EXCLUDE, 64))
    eth0 = next(n for n in facts["nics"] if n["device"] == "eth0")
    assert (eth0["operstate"], eth0["rx_errors"], eth0["tx_dropped"]) == ("up", 4, 7)
    assert {n["device"] for n in facts["nics"]} == {"eth0", "eth1", "ens1f0np0", "ib0"}
    port = next(p for p in facts["ib_ports"] if p["device"] == "mlx5_0")
    assert port["port"] == "1" and "xmit_wait" in port and "link_downed" in port
