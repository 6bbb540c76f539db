"""The service's own Redis client's encoder (nextstep/service/resp.py): hiredis's and the Python one agree."""

import math

import pytest

from nextstep.service.resp import pack, pack_python

ARGS = [("GET", "k"), ("EVALSHA", "f" * 40, 2, "a:{x}", "b:{x}", -1, b"\x00\xff" * 1000, 1.5, 1e20, 0.1),
        ("HSET", "é", "", b"", 2 ** 70, -(2 ** 70)), ("SET", "k", math.nan), ("SET", "k", memoryview(b"ab"))]


@pytest.mark.parametrize("args", ARGS, ids=range(len(ARGS)))
def test_hiredis_and_python_encode_a_command_alike(args):
    assert pack(*args) == pack_python(*args)


def test_what_hiredis_does_not_take_is_encoded_in_python():
    assert pack("SET", "k", True) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n"
    assert pack("SET", "k", bytearray(b"v")) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"
