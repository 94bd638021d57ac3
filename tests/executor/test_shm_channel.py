"""The shared-memory command channel: round trips, growth past its capacity, no leaks."""
import os

import pytest

from nanovllm.executor.shm_channel import DEFAULT_CAPACITY, CommandChannel


def segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def channel():
    writer = CommandChannel.create()
    reader = CommandChannel.attach(writer.name)
    yield writer, reader
    reader.close()
    writer.close()


def test_round_trip_in_order(channel):
    writer, reader = channel
    assert writer.capacity == DEFAULT_CAPACITY == 1 << 20
    writer.write("run", ([1, 2, 3], True))
    assert reader.read() == ("run", ([1, 2, 3], True))
    writer.write("run", ({"a": 1.5}, False))
    assert reader.read() == ("run", ({"a": 1.5}, False))
    writer.write("shutdown", ())
    assert reader.read() == ("shutdown", ())


def test_reading_a_command_twice_is_an_error(channel):
    writer, reader = channel
    writer.write("run", (1,))
    reader.read()
    with pytest.raises(RuntimeError, match="out of step: expected command 2, found 1"):
        reader.read()


def test_command_bigger_than_the_buffer_grows_the_channel_intact():
    writer = CommandChannel.create(capacity=4096)
    reader = CommandChannel.attach(writer.name)
    first = writer.name
    big = list(range(100_000))  # ~500 KB pickled, over 100x the buffer
    writer.write("run", (big, True))
    assert writer.capacity >= 500_000 and writer.name != first
    assert not segment_exists(first)  # the outgrown segment is unlinked at once
    assert reader.read() == ("run", (big, True))  # whole, not truncated
    assert reader.name == writer.name
    writer.write("run", ([7], False))  # small commands keep using the bigger segment
    assert reader.read() == ("run", ([7], False))
    grown = writer.name
    reader.close()
    writer.close()
    assert not segment_exists(grown)


def test_close_unlinks_and_names_are_unique():
    a, b = CommandChannel.create(), CommandChannel.create()
    assert a.name != b.name and segment_exists(a.name) and segment_exists(b.name)
    names = a.name, b.name
    a.close()
    b.close()
    a.close()  # idempotent
    assert not any(segment_exists(n) for n in names)
