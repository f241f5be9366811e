"""What a message carries besides its bytes, and how it is encoded: the header of a
message through a process group, and the announcement with which a kit collective names
itself to a peer (its number, signature and description), both read back on the host.

A message through shared memory has a header of its own (:func:`overlapkit.shm.pack_header`).
"""

from __future__ import annotations

import struct

import torch

#: a header through a process group: departed, bytes, op number, op signature
_GROUP_HEADER = 4


def _group_header(departed: float, nbytes: int, seq: int, signature: int) -> torch.Tensor:
    return torch.tensor([departed, nbytes, seq, signature], dtype=torch.float64)


def _read_group_header(header: torch.Tensor) -> list:
    """(departed, bytes, op number, op signature) of a received header, as floats."""
    return _host(header).tolist()


_side_streams: dict = {}


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A small received tensor on the host, without synchronising the caller's CUDA stream."""
    if tensor.device.type != "cuda":
        return tensor
    side = _side_streams.get(tensor.device)
    if side is None:
        side = _side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
    # the caller's stream, read before the switch: inside the block the current stream
    # is the side one, and a stream that waits for itself orders nothing
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
    side.synchronize()  # this side stream only, not the device
    return out


#: an announcement: op number, signature, then the op's description in UTF-8
_ANNOUNCE = struct.Struct("<qqH")
_ANNOUNCE_BYTES = 512


def _announcement(op, device) -> torch.Tensor:
    """``op``'s announcement (a :class:`overlapkit.kitops.Op`: its number, signature and
    description) as a tensor on ``device``."""
    text = op.description.encode()[: _ANNOUNCE_BYTES - _ANNOUNCE.size]
    raw = _ANNOUNCE.pack(op.seq, op.signature, len(text)) + text
    buf = torch.zeros(_ANNOUNCE_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _read_announcement(buf: torch.Tensor) -> tuple[int, int, str]:
    raw = bytes(_host(buf).tolist())
    seq, signature, n = _ANNOUNCE.unpack_from(raw)
    return seq, signature, raw[_ANNOUNCE.size : _ANNOUNCE.size + n].decode("utf-8", "replace")
