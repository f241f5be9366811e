"""overlapkit.machine: the platform choices, each tested on Linux with the other
platforms' facts injected (addresses, sizes, environments); and shm's macOS fallbacks."""

from __future__ import annotations

import importlib.util
import os
import select
import socket
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

import overlapkit as ok
from overlapkit import launcher, machine, shm

MiB = 1 << 20


def _addr(address: str, family=socket.AF_INET):
    return SimpleNamespace(family=family, address=address)


#: what psutil.net_if_addrs() says on a Mac: en0 first, loopback lo0 (with its IPv6 too)
MACOS_ADDRESSES = {
    "en0": [_addr("192.168.1.20"), _addr("fe80::1", socket.AF_INET6)],
    "lo0": [_addr("::1", socket.AF_INET6), _addr("127.0.0.1")],
}
LINUX_ADDRESSES = {"eth0": [_addr("10.0.0.5")], "lo": [_addr("127.0.0.1")]}


def _statvfs(size: int, free: int | None = None, block: int = 4096):
    free = size if free is None else free
    fake = SimpleNamespace(f_frsize=block, f_blocks=size // block, f_bavail=free // block)
    return lambda path: fake


def _no_statvfs(path):
    raise FileNotFoundError(2, "No such file or directory", path)


# --------------------------------------------------------------------------- Windows


def test_native_windows_is_refused_naming_wsl2():
    with pytest.raises(ImportError) as caught:
        machine.refuse_native_windows("win32")
    text = str(caught.value)
    for word in ("native Windows", "fork", "fcntl", "/dev/shm", "WSL2", "wsl --install"):
        assert word in text, text


def test_linux_and_macos_are_not_refused():
    machine.refuse_native_windows("linux")
    machine.refuse_native_windows("darwin")


def test_importing_the_kit_on_native_windows_says_use_wsl2_before_any_posix_import():
    code = "import sys; sys.platform = 'win32'; import overlapkit"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "WSL2" in last, run.stderr
    assert "machine.py" in run.stderr and "shm.py" not in run.stderr, run.stderr


# --------------------------------------------------------------------------- loopback


def test_macos_loopback_is_lo0_found_from_its_addresses():
    assert machine.loopback_interface(MACOS_ADDRESSES, system="darwin") == "lo0"


def test_linux_loopback_is_lo_found_from_its_addresses():
    assert machine.loopback_interface(LINUX_ADDRESSES, system="linux") == "lo"


def test_a_loopback_of_another_name_is_found_not_assumed():
    addresses = {"eth0": [_addr("10.0.0.5")], "loopback0": [_addr("127.0.0.1")]}
    assert machine.loopback_interface(addresses, system="linux") == "loopback0"


def test_with_no_interface_carrying_127_0_0_1_the_platforms_usual_name_is_used():
    only_public = {"en0": [_addr("192.168.1.20"), _addr("127.0.0.1", socket.AF_INET6)]}
    assert machine.loopback_interface(only_public, system="darwin") == "lo0"
    assert machine.loopback_interface(only_public, system="linux") == "lo"
    assert machine.loopback_interface({}, system="freebsd14") == "lo0"


def test_this_machines_loopback_is_the_interface_psutil_shows_with_127_0_0_1():
    import psutil

    name = machine.loopback_interface()
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[name]]


# --------------------------------------------------------------------------- socket env


def test_a_users_own_gloo_socket_ifname_is_kept():
    env = machine.socket_env({"GLOO_SOCKET_IFNAME": "eth1"}, MACOS_ADDRESSES, system="darwin")
    assert env == {"NCCL_SOCKET_IFNAME": "lo0"}


def test_a_users_own_nccl_socket_ifname_is_kept():
    env = machine.socket_env({"NCCL_SOCKET_IFNAME": "=lo"}, LINUX_ADDRESSES, system="linux")
    assert env == {"GLOO_SOCKET_IFNAME": "lo"}


def test_unset_socket_ifnames_get_the_loopback_found_on_macos():
    env = machine.socket_env({}, MACOS_ADDRESSES, system="darwin")
    assert env == {"GLOO_SOCKET_IFNAME": "lo0", "NCCL_SOCKET_IFNAME": "lo0"}


def test_an_empty_socket_ifname_counts_as_unset():
    env = machine.socket_env({"GLOO_SOCKET_IFNAME": ""}, LINUX_ADDRESSES, system="linux")
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_when_the_user_set_both_no_interface_is_looked_up():
    class Unreadable(dict):
        def items(self):
            raise AssertionError("interfaces looked up although nothing needs them")

    user = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert machine.socket_env(user, Unreadable(), system="linux") == {}


def _socket_ifnames():
    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")


@pytest.mark.usefixtures("no_leftover_ranks")
def test_ranks_see_the_callers_own_socket_ifnames(monkeypatch):
    loopback = machine.loopback_interface()  # gloo must still be able to use it
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", f"={loopback}")  # NCCL's exact-match form
    seen = ok.launch(_socket_ifnames, world_size=2, quiet=True)
    assert seen == [(loopback, f"={loopback}")] * 2


@pytest.mark.usefixtures("no_leftover_ranks")
def test_ranks_see_the_found_loopback_when_the_caller_unset_what_the_forkserver_had(
    monkeypatch,
):
    # the forkserver starts with the caller's environment of that moment, and its ranks
    # inherit it: a variable unset since then must not pass for the user's own setting
    loopback = machine.loopback_interface()
    launcher.shutdown()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", f"={loopback}")
    ok.launch(_socket_ifnames, world_size=2, quiet=True)  # a cold start: the server has them
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    seen = ok.launch(_socket_ifnames, world_size=2, quiet=True)
    assert seen == [(loopback, loopback)] * 2


# --------------------------------------------------------------------------- /dev/shm


def test_overlapkit_shm_dir_wins_on_every_platform(tmp_path):
    env = {"OVERLAPKIT_SHM_DIR": str(tmp_path)}
    for system in ("linux", "darwin"):
        assert machine.shm_root(env, system, statvfs=_statvfs(1 * MiB)) == str(tmp_path)


def test_an_overlapkit_shm_dir_that_is_no_writable_folder_means_a_temporary_folder(tmp_path):
    env = {"OVERLAPKIT_SHM_DIR": str(tmp_path / "missing")}
    assert machine.shm_root(env, "linux", dev_shm=str(tmp_path)) is None


def test_linux_puts_link_bytes_in_dev_shm_even_dockers_64_mib_one(tmp_path):
    found = machine.shm_root({}, "linux", dev_shm=str(tmp_path), statvfs=_statvfs(64 * MiB))
    assert found == str(tmp_path)


def test_a_dev_shm_too_small_for_the_link_means_a_temporary_folder(tmp_path):
    found = machine.shm_root({}, "linux", dev_shm=str(tmp_path), statvfs=_statvfs(4 * MiB))
    assert found is None


def test_macos_has_no_dev_shm_so_link_bytes_go_to_a_temporary_folder(tmp_path):
    # not even a folder of that name (a user's own) is taken for tmpfs there
    found = machine.shm_root({}, "darwin", dev_shm=str(tmp_path), statvfs=_statvfs(8 << 30))
    assert found is None
    assert machine.shm_root({}, "darwin", dev_shm="/nonexistent/shm") is None


def test_the_launcher_takes_its_shm_root_from_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("OVERLAPKIT_SHM_DIR", str(tmp_path))
    assert launcher._shm_root() == str(tmp_path)
    monkeypatch.delenv("OVERLAPKIT_SHM_DIR")
    assert launcher._shm_root() == machine.shm_root(os.environ)


def test_a_64_mib_dev_shm_is_reported_before_nccl_fails_in_it():
    report = machine.shm_report("/dev/shm", _statvfs(64 * MiB, free=60 * MiB))
    assert report is not None
    for word in ("64 MiB", "60 MiB free", "NCCL", "Docker", "--ipc=host", "--shm-size=1g",
                 "NCCL_SHM_DISABLE=1", "slower", "512 MiB"):  # fmt: skip
        assert word in report, report


def test_a_large_dev_shm_is_not_reported():
    assert machine.shm_report("/dev/shm", _statvfs(8 << 30)) is None
    assert machine.shm_report("/dev/shm", _statvfs(machine.NCCL_SHM_MIN_BYTES)) is None


def test_a_dev_shm_that_cannot_be_measured_is_not_reported():
    assert machine.shm_report("/dev/shm", _no_statvfs) is None


def test_a_small_dev_shm_is_warned_about_once_per_process_for_nccl(monkeypatch):
    monkeypatch.setattr(machine, "_warned_small_shm", False)
    small = _statvfs(64 * MiB)
    with pytest.warns(machine.SmallSharedMemoryWarning, match="--ipc=host"):
        machine.warn_small_shm("nccl", statvfs=small)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        machine.warn_small_shm("nccl", statvfs=small)  # the second time: silent


def test_gloo_is_not_warned_about_a_small_dev_shm_but_a_mixed_backend_is(monkeypatch):
    monkeypatch.setattr(machine, "_warned_small_shm", False)
    small = _statvfs(64 * MiB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        machine.warn_small_shm("gloo", statvfs=small)
        machine.warn_small_shm("nccl", statvfs=_statvfs(8 << 30))
    with pytest.warns(machine.SmallSharedMemoryWarning):
        machine.warn_small_shm("cpu:gloo,cuda:nccl", statvfs=small)


# --------------------------------------------------------------------------- devices


def test_cuda_visible_devices_unset_means_every_device():
    assert machine.visible_devices({}) is None


def test_cuda_visible_devices_set_empty_means_none():
    assert machine.visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_cuda_visible_devices_lists_indices_and_uuids_in_order():
    env = {"CUDA_VISIBLE_DEVICES": "3, 1,GPU-8a1e"}
    assert machine.visible_devices(env) == ["3", "1", "GPU-8a1e"]


# --------------------------------------------------------------------------- shm on macOS


def test_without_posix_fallocate_as_on_macos_the_link_still_carries_messages(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "posix_fallocate")  # macOS has none
    out = shm.Outgoing(str(tmp_path / "x-0-1"))
    inc = shm.Incoming(str(tmp_path / "x-0-1"))
    data = bytes(range(256)) * (3 * MiB // 256)  # spans several reserve steps
    buf = bytearray(data)
    address = (shm.ctypes.c_char * len(buf)).from_buffer(buf)
    placed = out.put(shm.ctypes.addressof(address), len(data))
    assert placed is not None
    offset, msg_id = placed
    assert out.reserved >= shm._CONTROL + len(data)
    with out.lock:
        out.post(shm.pack_header(0.0, len(data), offset, msg_id, 1, 0, 0, len(data)))
    inc.poll(1.0)
    header = inc.read_header()
    assert header is not None and header[2] == offset
    back = bytearray(len(data))
    inc.copy_out(shm.ctypes.addressof((shm.ctypes.c_char * len(back)).from_buffer(back)),
                 len(data), offset)  # fmt: skip
    assert bytes(back) == data


def test_reserving_without_posix_fallocate_backs_the_bytes_with_blocks(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "posix_fallocate")
    path = tmp_path / "sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 8 * MiB)
        before = os.fstat(fd).st_blocks
        shm._allocate(fd, MiB, 3 * MiB)
        assert (os.fstat(fd).st_blocks - before) * 512 >= 3 * MiB
        assert os.fstat(fd).st_size == 8 * MiB
    finally:
        os.close(fd)


def test_a_header_and_its_description_fit_one_atomic_pipe_write_on_macos(monkeypatch):
    monkeypatch.setattr(select, "PIPE_BUF", 512)  # macOS's (Linux's is 4096)
    spec = importlib.util.spec_from_file_location("shm_as_on_macos", shm.__file__)
    on_macos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(on_macos)
    header = on_macos.pack_header(0.0, 1, 0, 1, 1, 0, 0, 1, b"x" * 4096)
    assert len(header) <= 512
    assert shm.MAX_DESCRIPTION == 1024  # unchanged on Linux
