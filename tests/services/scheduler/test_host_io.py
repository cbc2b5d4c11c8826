"""The step's one upload and one readback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scheduler.host_io import HostReadback, HostUpload


def test_upload_keeps_each_arrays_dtype_and_shape_and_readback_restores_them():
    upload, readback = HostUpload(torch.device("cpu")), HostReadback()
    arrays = {"ids": np.arange(5, dtype=np.int64), "mask": np.array([[True, False]]), "t": np.full(3, 0.5, np.float32)}
    sent = upload.send(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(sent[name].numpy(), array)
    handles = [readback.add(sent["t"]), readback.add(sent["ids"].to(torch.int32))]
    host = readback.fetch()
    np.testing.assert_array_equal(host[handles[0]], arrays["t"])
    np.testing.assert_array_equal(host[handles[1]], arrays["ids"])
    assert readback.num_copies == 1


def test_upload_parts_after_padding_and_empty_parts_keep_their_values():
    # 12 and 1 bytes leave padding before the next 8-byte-aligned part; empty parts (no drafts, a
    # 0-row table) take no bytes; 2-D parts keep their shape, 1-D ones their length
    upload = HostUpload(torch.device("cpu"))
    arrays = {"lens": np.array([3, 1, 2], np.int32), "flag": np.array([True]), "none": np.zeros(0, np.int64),
              "table": np.arange(6, dtype=np.int32).reshape(2, 3), "rows": np.zeros((0, 4), np.int64),
              "ids": np.array([7, -9], np.int64), "temps": np.array([0.5, 1.0, 0.25], np.float32)}  # fmt: skip
    for _ in range(2):  # the second send reuses the buffer
        sent = upload.send(arrays)
        assert list(sent) == list(arrays)
        for name, array in arrays.items():
            assert sent[name].shape == array.shape and sent[name].dtype == torch.from_numpy(array).dtype, name
            np.testing.assert_array_equal(sent[name].numpy(), array)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned buffer's race exists on CUDA only")
def test_a_second_send_does_not_overwrite_inputs_whose_copy_has_not_run():
    """A step with nothing to read back returns before its upload has run; the next step's send
    must wait for that copy before it rewrites the shared pinned buffer."""
    upload = HostUpload(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # keep the stream busy, so the first copy waits in the queue
    first = upload.send({"ids": np.arange(1024, dtype=np.int64)})
    upload.send({"ids": np.full(1024, -1, dtype=np.int64)})
    torch.cuda.synchronize()
    np.testing.assert_array_equal(first["ids"].cpu().numpy(), np.arange(1024))


def test_a_repeated_layout_reuses_its_views_and_reads_each_sends_values():
    """Views are made once per layout (names, dtypes, shapes); each send's values come through them,
    also after another layout and after the buffer grew."""
    upload = HostUpload(torch.device("cpu"))
    small = {"ids": np.array([1, 2], np.int64), "lens": np.array([3], np.int32)}
    other = {"ids": np.array([5], np.int64)}  # fits the buffer the first send made
    first = upload.send(small)
    assert upload.send(other)["ids"].tolist() == [5]
    again = upload.send({"ids": np.array([8, 9], np.int64), "lens": np.array([4], np.int32)})
    assert again["ids"] is first["ids"] and again["ids"].tolist() == [8, 9] and again["lens"].tolist() == [4]
    grown = upload.send({"ids": np.arange(10_000, dtype=np.int64)})  # past the buffer: a new one
    np.testing.assert_array_equal(grown["ids"].numpy(), np.arange(10_000))
    after = upload.send({"ids": np.array([-1, -2], np.int64), "lens": np.array([7], np.int32)})
    assert after["ids"].tolist() == [-1, -2] and after["lens"].tolist() == [7]
    assert after["ids"].untyped_storage().data_ptr() == grown["ids"].untyped_storage().data_ptr()  # views of the new buffer


def test_readback_brings_int64_parts_back_as_int32_small_as_halves_large_narrowed():
    readback = HostReadback()
    small = torch.tensor([[-5], [2**31 - 1], [0]], dtype=torch.int64)  # [P, 1]: a decode step's tokens
    large = torch.arange(-3, 5000, dtype=torch.int64)  # past MAX_HALVES_NUMEL
    values = torch.tensor([0.25, -1.5])
    handles = [readback.add(small), readback.add(large), readback.add(values)]
    host = readback.fetch()
    for handle, tensor in zip(handles, (small, large, values), strict=True):
        assert host[handle].dtype == (np.float32 if tensor.is_floating_point() else np.int32)
        np.testing.assert_array_equal(host[handle], tensor.numpy())
    alone = readback.add(small)  # one part: copied as it is
    np.testing.assert_array_equal(readback.fetch()[alone], small.numpy())
    assert readback.num_copies == 2


def test_parts_back_to_back_in_one_buffer_are_read_as_one_span_and_others_are_joined():
    from services.scheduler.host_io import one_span

    buffer = torch.arange(10, dtype=torch.int32)
    adjacent = [buffer[0:3], buffer[3:3], buffer[3:7], buffer[7:10]]  # an empty part in between changes nothing
    span, starts = one_span(adjacent)
    assert span.data_ptr() == buffer.data_ptr() and span.tolist() == list(range(10)) and starts == [0, 3, 3, 7]
    assert one_span([buffer[3:6], buffer[0:3]]) is None  # out of order
    assert one_span([buffer[0:3], buffer[3:6].clone()]) is None  # another storage
    assert one_span([buffer[0:3], buffer[7:10]]) is None  # more padding than MAX_GAP_WORDS (3) between them
    assert one_span([buffer[0:0]]) is None
    readback = HostReadback()
    handles = [readback.add(part) for part in adjacent]
    host = readback.fetch()
    assert readback.num_joined == 0 and [host[h].tolist() for h in handles] == [p.tolist() for p in adjacent]


def test_parts_apart_by_a_few_words_of_padding_are_still_one_span_and_read_past_it():
    """A packed buffer aligns its columns to 16 bytes (logprob_graphs._packed_buffer): up to three
    words of padding between parts; the one copy covers them and each part is read at its place."""
    from services.scheduler.host_io import one_span

    buffer = torch.arange(20, dtype=torch.int32)
    parts = [buffer[0:2], buffer[4:5], buffer[5:5], buffer[8:11], buffer[12:20]]  # gaps 2, 0, 3 and 1 words
    span, starts = one_span(parts)
    assert span.data_ptr() == buffer.data_ptr() and span.numel() == 20 and starts == [0, 4, 5, 8, 12]  # each part's place
    readback = HostReadback()
    handles = [readback.add(part) for part in parts]
    floats = buffer[12:20].view(torch.float32)  # a float column among them reads back as floats
    readback.add(floats)
    host = readback.fetch()
    assert readback.num_copies == 1 and readback.num_joined == 1  # the float part repeats [12:20]: joined
    readback = HostReadback()
    handles = [readback.add(part) for part in parts]
    host = readback.fetch()
    assert readback.num_joined == 0 and [host[h].tolist() for h in handles] == [p.tolist() for p in parts]
