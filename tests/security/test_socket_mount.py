"""Security issue 28, last item: the socket every training pod on the node connects to.

The example training pods used to mount the `/run/sidecar` hostPath read-write, and they run as
root: any one of them could remove the sidecar's socket, or rename its own socket over it, and
every other pod's hooks would then talk to it (or to nothing). The examples now mount the socket's
directory read-only, and only the sidecar's `diag_dir` (`/run/sidecar/diag`, where the sidecar
creates each rank's stack-dump file) read-write, nested inside it.

Kernel facts this rests on, checked here with real mounts (a private mount namespace per "pod",
the examples' hostPath mounts made as the container runtime makes them, root with the capability
set a container gets, so without CAP_SYS_ADMIN):
- connect() to a Unix socket needs no write access to its mount: a read-only mount is fine;
- unlink, rename, bind and chmod in a read-only mount fail (EROFS; a rename from the writable
  diag mount onto the socket is across mounts: EXDEV), and without CAP_SYS_ADMIN the pod can
  neither unmount nor remount it;
- a regular file on a read-only mount cannot be opened for writing (EROFS), so the stack-dump
  files (opened O_WRONLY|O_APPEND by the hooks) need the writable diag mount.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.security.rig import next_result, open_sidecar, ranks_of
from tests.security.test_deploy_examples import _pod_specs
from tests.support import ROOT, kill_tree, wait_until

EXAMPLES = ROOT / "deploy" / "kubernetes" / "examples"
CONFIGMAP = ROOT / "deploy" / "kubernetes" / "base" / "configmap.yaml"
HOST_DIR = PurePosixPath("/run/sidecar")  # the hostPath of the socket's directory on a node

# The capabilities containerd and Docker give a container by default: no CAP_SYS_ADMIN.
CONTAINER_CAPS = (
    "chown,dac_override,fsetid,fowner,mknod,net_raw,setgid,setuid,setfcap,setpcap,net_bind_service,"
    "sys_chroot,kill,audit_write"
)

Mount = tuple[str, str, bool]  # (hostPath, mountPath, read-only)


# Real mounts in a private mount namespace: root with CAP_SYS_ADMIN, util-linux's unshare and setpriv.
needs_mounts = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, unshare and setpriv to make a pod's mounts",
)


def host_mounts(name: str) -> list[Mount]:
    """The hostPath mounts of the example's training containers (all alike), by mount depth."""
    layouts = set()
    for doc in yaml.safe_load_all((EXAMPLES / name).read_text()):
        for pod in _pod_specs(doc or {}):
            volumes = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
            for c in pod["containers"]:
                layouts.add(
                    tuple(
                        (volumes[m["name"]], m["mountPath"], bool(m.get("readOnly")))
                        for m in c.get("volumeMounts", [])
                        if m["name"] in volumes
                    )
                )
    (layout,) = layouts
    return sorted(layout, key=lambda m: len(PurePosixPath(m[1]).parts))


def sidecar_paths() -> tuple[str, str]:
    """(socket, diag_dir) of the shipped ConfigMap."""
    settings = yaml.safe_load(yaml.safe_load(CONFIGMAP.read_text())["data"]["sidecar.yaml"])
    return settings["socket"], settings["diag_dir"]


def on_this_node(path: str, node_dir: Path) -> Path:
    """A node's path under /run/sidecar, as the test's stand-in directory for it."""
    return node_dir / PurePosixPath(path).relative_to(HOST_DIR)


def in_pod(mounts: list[Mount], node_dir: Path, argv: list[str], **popen) -> subprocess.Popen:
    """`argv` as root with a container's capabilities, in a private mount namespace where the
    example's hostPath mounts are made as kubelet and the runtime make them (each hostPath bound
    at its mountPath, read-only where it says so): the pod's view of the node's /run/sidecar.
    The pod's paths are the node's (mountPath == hostPath), so the sidecar's answers hold there."""
    script = ["set -e"]
    for host, inside, read_only in mounts:
        source, target = on_this_node(host, node_dir), on_this_node(inside, node_dir)
        source.mkdir(mode=0o755, exist_ok=True)  # hostPath type DirectoryOrCreate
        source, target = shlex.quote(str(source)), shlex.quote(str(target))
        script += [f"mount --bind {source} {target}", f"mount -o remount,bind,{'ro' if read_only else 'rw'} {target}"]
    script.append(f'exec setpriv --bounding-set -all,+{CONTAINER_CAPS.replace(",", ",+")} -- "$@"')
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "pod", *argv]
    return subprocess.Popen(cmd, start_new_session=True, **popen)


def answers(socket_path: str) -> bool:
    """Whether the sidecar answers /healthz on its socket (the other pods' way in)."""
    from sidecar.commands.client import UnixHTTPConnection

    conn = UnixHTTPConnection(socket_path, timeout=10)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.fixture(params=["pytorchjob.yaml", "jobset.yaml", "trainjob.yaml"])
def example(request) -> list[Mount]:
    return host_mounts(request.param)


# Root in the pod tries everything that would take the socket from the other pods.
ATTACK = r"""
import json, os, socket, sys
sock, diag = sys.argv[1], sys.argv[2]
out = {}
def attempt(name, action):
    try:
        action()
        out[name] = "done"
    except OSError as e:
        out[name] = e.errno

def rename_own_socket_over_it():
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(diag, "evil.sock"))
    os.rename(os.path.join(diag, "evil.sock"), sock)

def bind_after_unlink():
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock)

def replace_through_a_new_name():
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock + ".new")
    os.rename(sock + ".new", sock)

def command(*argv):
    import subprocess
    if subprocess.run(argv, capture_output=True).returncode:
        raise PermissionError(1, "refused")

attempt("unlink", lambda: os.unlink(sock))
attempt("rename_over", rename_own_socket_over_it)
attempt("bind", bind_after_unlink)
attempt("rename_new", replace_through_a_new_name)
attempt("chmod", lambda: os.chmod(sock, 0o600))
attempt("chown", lambda: os.chown(sock, 65534, 65534))
attempt("umount", lambda: command("umount", os.path.dirname(sock)))
attempt("remount_rw", lambda: command("mount", "-o", "remount,bind,rw", os.path.dirname(sock)))
print(json.dumps(out), flush=True)
"""

FRAME = "stuck_in_frame_5f3a"
# A rank with the real hooks, in the pod: registers, pushes steps; reports the dump file it adopted.
RANK = f"""
import json, signal, time
from trainer_hooks import Monitor
mon = Monitor(job_id="mounted", rank=0, world_size=1, flush_interval=0.2, stack_signal=signal.SIGUSR2)
def {FRAME}():
    step, reported, deadline = 0, False, time.monotonic() + 30
    while True:
        step += 1
        mon.step(step, loss=1.0)
        if not reported and (mon.stack_dump_path or time.monotonic() > deadline):
            print("RESULT " + json.dumps({{"path": mon.stack_dump_path}}), flush=True)
            reported = True
        time.sleep(0.1)
{FRAME}()
"""


def test_the_examples_mount_the_socket_directory_read_only_and_only_the_diag_dir_writable(example):
    socket, diag_dir = sidecar_paths()
    socket_dir = str(PurePosixPath(socket).parent)
    assert example == [(socket_dir, socket_dir, True), (diag_dir, diag_dir, False)]


@needs_mounts
def test_root_in_a_training_pod_cannot_remove_or_replace_the_socket(example):
    """Root in the example's layout, with a container's capabilities: unlink, rename over, bind,
    chmod, chown, unmount, remount read-write all refused; the socket the other pods use is the
    same file and still answers."""
    with open_sidecar() as sidecar:
        node_dir = Path(sidecar.socket).parent
        assert (node_dir / "diag") == on_this_node(sidecar_paths()[1], node_dir)
        before = os.stat(sidecar.socket)
        pod = in_pod(
            example,
            node_dir,
            [sys.executable, "-c", ATTACK, sidecar.socket, str(node_dir / "diag")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = pod.communicate(timeout=60)
        assert pod.returncode == 0, err
        tried = json.loads(out.splitlines()[-1])
        assert "done" not in tried.values(), tried
        after = os.stat(sidecar.socket)
        assert (after.st_ino, after.st_mode, after.st_uid) == (before.st_ino, before.st_mode, before.st_uid)
        assert answers(sidecar.socket), "the sidecar's socket no longer answers"


@needs_mounts
def test_a_rank_in_a_training_pod_registers_pushes_and_gets_its_stack_dump_written(example):
    """The real hooks in the example's layout: they register and push through the read-only
    mount, open the dump file the sidecar created in the writable diag_dir, and faulthandler
    writes the rank's stack there on the dump signal."""
    with open_sidecar("hooks_flush_interval_seconds=0.2") as sidecar:
        node_dir = Path(sidecar.socket).parent
        rank = in_pod(
            example,
            node_dir,
            [sys.executable, "-c", RANK],
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")},
                "PYTHONPATH": str(ROOT),
                "SIDECAR_SOCKET": sidecar.socket,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            adopted = next_result(rank, 60)["path"]
            assert adopted is not None, "the hooks could not open their stack-dump file in the pod"
            assert Path(adopted).parent.parent == node_dir / "diag"
            wait_until(
                lambda: (ranks_of(sidecar, "mounted").get(0, {}).get("step") or 0) >= 5,
                30,
                what="the rank's pushes from inside the pod",
            )
            assert ranks_of(sidecar, "mounted")[0]["pid"] == rank.pid  # registered over the socket, verified
            os.kill(rank.pid, signal.SIGUSR2)  # what the sidecar sends a hung rank first
            wait_until(lambda: FRAME in Path(adopted).read_text(), 30, what="the stack dump in the rank's file")
        finally:
            kill_tree(rank)


@needs_mounts
def test_the_layout_the_examples_replace_let_a_pod_remove_the_socket():
    """Not a test of the examples: the kernel facts above, checked on the old layout (one
    read-write mount of /run/sidecar), so the test above cannot pass for a reason of this
    machine's (a mount or capability that refuses everything anyway)."""
    with open_sidecar() as sidecar:
        node_dir = Path(sidecar.socket).parent
        pod = in_pod(
            [("/run/sidecar", "/run/sidecar", False)],
            node_dir,
            [sys.executable, "-c", ATTACK, sidecar.socket, str(node_dir / "diag")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = pod.communicate(timeout=60)
        assert pod.returncode == 0, err
        tried = json.loads(out.splitlines()[-1])
        assert tried["unlink"] == "done" and tried["rename_over"] == "done", tried
