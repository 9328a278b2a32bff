"""The node checks of `sidecar preflight`: network links, the rendezvous endpoint, shared
storage and checkpoint space, the clock, and the node's own sidecar."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterable
from pathlib import Path

from sidecar.commands.client import StatusError, fetch_json, resolve_endpoint
from sidecar.commands.verdict import EXIT_HEALTHY, assess
from sidecar.config import ConfigError, parse_hostport
from sidecar.preflight.facts import mount_of, read_clock_sync, read_ib_ports, read_nics, write_probe
from sidecar.preflight.results import FAIL, PASS, SKIP, WARN, Context, Result

MARKER_NAME = ".sidecar-preflight-marker"
CONNECT_TIMEOUT_SECONDS = 3.0

NETWORK_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "cifs",
    "smb3",
    "ceph",
    "cephfs",
    "beegfs",
    "wekafs",
    "glusterfs",
    "9p",
    "virtiofs",
    "fuse",
)


def check_nics(ctx: Context) -> Iterable[Result]:
    root = ctx.settings.collectors.sysfs_root
    nics = read_nics(root, ctx.settings.collectors.nic_exclude)
    if not nics:
        yield Result(
            "nics",
            WARN,
            f"no network interface in {root}/class/net (after collectors.nic_exclude)",
            "in a container, mount the host's /sys and set collectors.sysfs_root",
        )
        return
    yield links_result(
        "nics", nics, "not up: check the cable/switch port or exclude unused ones with collectors.nic_exclude"
    )


def check_infiniband(ctx: Context) -> Iterable[Result]:
    ports = read_ib_ports(ctx.settings.collectors.sysfs_root)
    if not ports:
        yield Result("infiniband", SKIP, "no InfiniBand/RoCE devices")
        return
    yield links_result(
        "infiniband", ports, "not ACTIVE: NCCL skips them; check `ibstat`, the cable and the subnet manager"
    )


def links_result(check: str, links: list, down_hint: str) -> Result:
    """PASS listing every link (name, state, speed), or WARN naming the ones that are down."""
    text = ", ".join(f"{link.name} {link.state}" + (f" {link.speed}" if link.speed else "") for link in links)
    down = [link.name for link in links if not link.up]
    if down:
        return Result(check, WARN, text, f"{', '.join(down)} {down_hint}")
    return Result(check, PASS, text)


def _is_local_address(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.create_server((host, port), reuse_port=False):
            return True
    except OSError:
        return False


def check_rendezvous(ctx: Context) -> Iterable[Result]:
    endpoint = ctx.args.rdzv_endpoint
    if not endpoint:
        yield Result("rendezvous", SKIP, "no --rdzv-endpoint given")
        return
    try:
        host, port = parse_hostport(endpoint, "--rdzv-endpoint")
    except ConfigError as e:
        yield Result("rendezvous", FAIL, str(e), "expected HOST:PORT, the value given to torchrun --rdzv-endpoint")
        return
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SECONDS):
            pass
    except socket.gaierror as e:
        yield Result(
            "rendezvous", FAIL, f"cannot resolve {host} ({e.strerror})", "check DNS / the endpoint's host name"
        )
    except ConnectionRefusedError:
        if _is_local_address(host):
            if _port_free(host, port):
                yield Result(
                    "rendezvous",
                    PASS,
                    f"{endpoint} is this node and the port is free: torchrun here will host the c10d store",
                )
            else:
                yield Result(
                    "rendezvous",
                    FAIL,
                    f"{endpoint} is this node but the port is taken",
                    "another process holds the port; pick another --rdzv-endpoint port",
                )
        else:
            yield Result(
                "rendezvous",
                WARN,
                f"{endpoint}: connection refused (reachable host, nothing listens yet)",
                f"fine before the job starts: the c10d store starts with torchrun on {host}",
            )
    except TimeoutError:
        yield Result(
            "rendezvous",
            FAIL,
            f"{endpoint}: no answer within {CONNECT_TIMEOUT_SECONDS:g}s",
            "a firewall or security group drops the port, or the host is down; open it between nodes",
        )
    except OSError as e:
        yield Result("rendezvous", FAIL, f"{endpoint}: {e.strerror or e}", "check routing between the nodes")
    else:
        yield Result("rendezvous", PASS, f"{endpoint} accepts connections")


def check_shared_dir(ctx: Context) -> Iterable[Result]:
    shared = ctx.args.shared_dir
    if not shared:
        yield Result("shared-storage", SKIP, "no --shared-dir given")
        return
    path = Path(shared)
    if not path.is_dir():
        yield Result("shared-storage", FAIL, f"{path} is not a directory", "mount the shared filesystem there")
        return
    mountpoint, fstype = mount_of(path)
    shared_fs = any(fstype == t or fstype.startswith(t + ".") for t in NETWORK_FILESYSTEMS)
    where = f"{path} on {mountpoint} ({fstype})"
    problem = write_probe(path)
    if problem:
        yield Result("shared-storage", FAIL, f"{where}: not writable ({problem})", "fix the mount's permissions")
    elif mountpoint == "/" or not shared_fs:
        yield Result(
            "shared-storage",
            WARN,
            f"{where}: writable, but not a network filesystem",
            "is the shared filesystem mounted? use --shared-marker to prove all nodes see the same files",
        )
    else:
        yield Result("shared-storage", PASS, f"{where}: mounted and writable")
    if ctx.args.shared_marker:
        yield _check_marker(path, ctx.args.shared_marker)


def _check_marker(directory: Path, spec: str) -> Result:
    mode, _, token = spec.partition(":")
    marker = directory / MARKER_NAME
    if mode not in ("write", "check") or not token:
        return Result("shared-marker", FAIL, f"bad --shared-marker {spec!r}", "use write:TOKEN or check:TOKEN")
    if mode == "write":
        body = {"token": token, "hostname": socket.gethostname(), "time": time.time()}
        try:
            marker.write_text(json.dumps(body) + "\n")
        except OSError as e:
            return Result("shared-marker", FAIL, f"cannot write {marker}: {e.strerror}", "fix the mount's permissions")
        return Result(
            "shared-marker",
            PASS,
            f"wrote {marker} with token {token!r}",
            f"run `sidecar preflight --shared-dir {directory} --shared-marker check:{token}` on the other nodes",
        )
    try:
        body = json.loads(marker.read_text())
    except OSError as e:
        return Result(
            "shared-marker",
            FAIL,
            f"no marker at {marker} ({e.strerror})",
            "this node does not see the files the writing node wrote: not the same storage, "
            "or `write:` has not run yet",
        )
    except ValueError:
        return Result("shared-marker", FAIL, f"{marker} is not a marker file", "rerun write:TOKEN on one node")
    if not isinstance(body, dict) or body.get("token") != token:
        found = body.get("token") if isinstance(body, dict) else None
        return Result(
            "shared-marker",
            FAIL,
            f"{marker} holds token {found!r}, not {token!r}",
            "a stale marker, or a different filesystem mounted at this path",
        )
    return Result("shared-marker", PASS, f"token {token!r} written by {body.get('hostname', '?')} is visible here")


def check_checkpoint_disk(ctx: Context) -> Iterable[Result]:
    if not (ctx.args.checkpoint_dir or ctx.settings.checkpoint_dir):
        yield Result(
            "checkpoint-disk", SKIP, "no checkpoint directory (--checkpoint-dir, or the checkpoint_dir setting)"
        )
        return
    directory = Path(ctx.args.checkpoint_dir or ctx.settings.checkpoint_dir).absolute()
    existing = next((p for p in [directory, *directory.parents] if p.exists()), Path("/"))
    usage = shutil.disk_usage(existing)
    free_gb = usage.free / 1e9
    note = "" if existing == directory else f" (does not exist yet; {existing} checked)"
    if not os.access(existing, os.W_OK):
        yield Result(
            "checkpoint-disk",
            FAIL,
            f"{directory}{note}: not writable by this user",
            "fix permissions; checkpoints would fail at the first save",
        )
    elif free_gb < ctx.args.min_free_gb:
        yield Result(
            "checkpoint-disk",
            FAIL,
            f"{directory}{note}: {free_gb:.1f} GB free, below {ctx.args.min_free_gb:g} GB",
            "free space or lower the number of checkpoints kept",
        )
    else:
        yield Result(
            "checkpoint-disk", PASS, f"{directory}{note}: {free_gb:.1f} GB free (>= {ctx.args.min_free_gb:g} GB)"
        )


def check_clock(ctx: Context) -> Iterable[Result]:
    synced, how = read_clock_sync()
    if synced is None:
        yield Result("clock", WARN, f"synchronisation unknown ({how})", "check chrony/ntpd by hand (chronyc tracking)")
    elif synced:
        yield Result("clock", PASS, f"synchronised ({how})")
    else:
        yield Result(
            "clock",
            WARN,
            f"not synchronised ({how})",
            "start chrony or ntpd: skewed clocks make logs, incidents and dashboards disagree across nodes",
        )


def check_sidecar(ctx: Context) -> Iterable[Result]:
    """The node's own sidecar: without it the job runs unwatched (the hooks drop quietly)."""
    endpoint = resolve_endpoint(ctx.args.socket, ctx.args.url)
    try:
        status = fetch_json(endpoint, "/v1/status")
    except StatusError as e:
        yield Result(
            "sidecar",
            WARN,
            f"{e}: the job would run without metrics or the watchdog",
            "start it (systemctl start sidecar / the DaemonSet), or point --socket/--url at it",
        )
        return
    verdict = assess(status)
    if verdict.unfit:
        yield Result(
            "sidecar",
            FAIL,
            f"sidecar at {endpoint} finds this node unfit: {'; '.join(verdict.unfit)}",
            "something outlived the last job here (docs/runbook.md#sidecarnodeunfit): drain the node and fix it "
            "before starting a job on it",
        )
    elif verdict.exit_code == EXIT_HEALTHY:
        yield Result("sidecar", PASS, f"sidecar {status.get('version', '?')} at {endpoint} is healthy")
    else:
        yield Result(
            "sidecar", WARN, f"sidecar at {endpoint} is degraded: {'; '.join(verdict.problems)}", "see `sidecar status`"
        )
