"""DeMo's codec (unison.engine.codecs.dct): the orthonormal DCT, the top-k per chunk, what is sent plus
what stays equals the momentum, the message's size, and the options refused with a clear error."""

from __future__ import annotations

import math

import pytest
import torch

import unison
from unison.engine.codecs.dct import FullTopK, codec, dct_matrix, message_bytes, transform_, transform_tiles_
from unison.engine.codecs.tiles import Tiles
from unison.engine.codecs.topk import BLOCK


@pytest.mark.parametrize("n", [1, 16, 64, 100])
def test_dct_is_orthonormal_and_matches_its_definition(n):
    d = dct_matrix(n, dtype=torch.float64)
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    k, j = 3 % n, 5 % n
    assert d[k, j].item() == pytest.approx(
        math.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n)
    )
    x = torch.randn(7, n)
    d32 = dct_matrix(n)
    assert torch.allclose((x @ d32.T) @ d32, x, atol=1e-5)  # the round trip


def test_each_tiles_2d_dct_in_place_by_blocks_and_back():
    """``transform_tiles_`` with ``D_h`` and ``D_w.T`` is each tile's 2-D DCT, ``D_h X D_w^T``
    (a scratch of fewer tiles than there are: blocks), and with ``D_h.T`` and ``D_w`` its inverse."""
    x = torch.randn(7, 8, 4, generator=torch.Generator().manual_seed(0))
    dh, dw = dct_matrix(8), dct_matrix(4)
    y = x.clone()
    transform_tiles_(y, dh, dw.T.contiguous(), torch.empty(3 * 32))
    for t in range(7):
        torch.testing.assert_close(y[t], dh @ x[t] @ dw.T, rtol=0, atol=1e-5)
    transform_tiles_(y, dh.T.contiguous(), dw, torch.empty(32))
    torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


def test_a_tiled_momentum_pairs_each_parameter_with_its_tiles():
    """``layout="tiles"``: the momentum lies tile after tile (the first 4 x 4 tile of a 16 x 8
    matrix first), each parameter's gradient folds into its tiles (``pair``), and the copies by
    name (checkpoints) and the saved gradients a redone round folds are shaped as the parameters."""
    from unison.algorithms.gradient.demo import Entry

    shapes = [torch.Size([16, 8]), torch.Size([6])]
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    entry = Entry(grads, chunk=4, device=torch.device("cpu"), tiles=Tiles(shapes, "tiles", 4, 0.25))
    torch._foreach_add_(entry.views, entry.pair(grads))
    assert torch.equal(entry.flat[:16], grads[0][:4, :4].reshape(-1))
    assert torch.equal(entry.flat[16:32], grads[0][:4, 4:].reshape(-1))
    assert all(torch.equal(a, b) for a, b in zip(entry.named(), grads))
    saved = [torch.zeros(s) for s in shapes]
    entry.lend(saved, 0.5, folded=True)  # the momentum folded, shaped as the parameters
    assert all(torch.equal(a, b) for a, b in zip(saved, grads))
    entry.flat.mul_(0.25)  # what the round left, once it sent some of it
    entry.lend(saved, 0.5, folded=False)
    assert all(torch.allclose(a, b - 0.5 * 0.25 * b) for a, b in zip(saved, grads))


def test_transform_in_place_by_blocks_is_the_matrix_product():
    x = torch.randn(300, 16)
    d = dct_matrix(16)
    expected = x @ d.T
    transform_(x, d.T.contiguous(), torch.empty(16 * 7))  # blocks of 7 rows
    assert torch.allclose(x, expected, atol=1e-6)


def test_full_topk_sends_the_largest_per_chunk_and_keeps_the_rest():
    torch.manual_seed(0)
    x = torch.randn(8 * 32)
    before = x.clone()
    c = FullTopK(x.numel(), chunk=32, topk=3)
    message = c.encode(x, c.empty())
    sent = c.decode_add(message, torch.zeros_like(x))
    rows, sent_rows = before.view(8, 32), sent.view(8, 32)
    for row, s in zip(rows, sent_rows):
        top = set(row.abs().topk(3).indices.tolist())
        assert set(s.nonzero().flatten().tolist()) == top
        assert torch.equal(s[list(top)], row[list(top)])  # float32 values: exact
    assert torch.equal(x + sent, before)  # nothing lost: the sent entries are zero in x
    assert (x.view(8, 32) != 0).sum(1).tolist() == [29] * 8


@pytest.mark.parametrize("bits", [None, 2, 4, 8])
def test_sent_plus_kept_is_the_momentum(bits):
    """One DeMo step's encode, as demo.py does it: DCT in place, top-k with feedback, inverse DCT in place."""
    torch.manual_seed(1)
    chunk, topk = 64, 4
    m = torch.randn(5 * chunk)
    original = m.clone()
    d = dct_matrix(chunk)
    scratch = torch.empty(max(BLOCK, chunk))
    c = codec(m.numel(), chunk, topk, bits, m.device, scratch)
    transform_(m.view(-1, chunk), d.T.contiguous(), scratch)
    message = c.encode(m, c.empty())
    transform_(m.view(-1, chunk), d, scratch)
    sent = c.decode_add(message, torch.zeros_like(m))
    transform_(sent.view(-1, chunk), d, scratch)
    assert torch.allclose(m + sent, original, atol=1e-5)
    assert c.nbytes == message_bytes(m.numel(), chunk, topk, bits) == message.numel()


def test_message_bytes():
    # 10 chunks of 64, 4 per chunk: float32 values and uint8 indices, 200 bytes
    assert message_bytes(640, 64, 4, None) == 200
    assert message_bytes(1024, 512, 2, None) == 24  # 4 entries of float32 and int16 (past 256 values per chunk)
    # 2-bit: 2 scales (8 bytes), 8 uint8 indices, 8 codes in 2 bytes, to a multiple of 4
    assert message_bytes(128, 64, 4, 2) == 20
    # bfloat16 scales: 2 chunks' scales in 4 bytes, then the same 8 indices and 2 bytes of codes
    assert message_bytes(128, 64, 4, 2, torch.bfloat16) == 16
    # demo:chunk=64,topk=2,bits=2 sends 6.5 bytes a chunk with float32 scales, 4.5 with bfloat16
    assert message_bytes(64 * 1000, 64, 2, 2) == 6500 and message_bytes(64 * 1000, 64, 2, 2, torch.bfloat16) == 4500


@pytest.mark.parametrize(
    "options, says",
    [
        ({"chunk": 0}, "chunk must be a positive integer"),
        ({"chunk": 8, "topk": 9}, r"topk must be at most chunk \(8\)"),
        ({"beta": 1.0}, r"beta must be a number in \[0, 1\)"),
        ({"beta": -0.1}, r"beta must be a number in \[0, 1\)"),
        ({"bits": 3}, "bits must be one of"),
        ({"sign": 1}, "sign must be True or False"),
        ({"bits": 32, "scale_dtype": "bf16"}, "scale_dtype must be unset when bits is 32"),
        ({"mean": "all"}, "mean must be one of 'senders', 'world'"),
        ({"bits": 2, "scale_dtype": "fp16"}, "scale_dtype must be one of 'fp32', 'bf16'"),
        ({"layout": "rows"}, "layout must be one of 'chunks', 'tiles'"),
        ({"layout": "tiles", "hierarchical": True}, "layout must be 'chunks' with hierarchical=True"),
    ],
)
def test_bad_options_are_refused(options, says):
    with pytest.raises(ValueError, match=says):
        unison.algorithms.create("demo", **options)


def test_the_name_and_options_form():
    a = unison.algorithms.create("demo:chunk=32,topk=2,sign=true,bits=4")
    assert (a.chunk, a.topk, a.sign, a.bits, a.beta) == (32, 2, True, 4, 0.999)
    paper = unison.algorithms.create("demo:bits=32")  # float32 values, as the paper sends
    assert paper.value_bits is None and paper.scale_dtype is None


def test_the_defaults_are_the_papers_algorithm_with_two_bit_values():
    """The sign of the mean over senders (pair it with SGD), 2 of each 64 coefficients in 2 bits
    with a bfloat16 scale: 4.5 bytes a chunk, 1/28 of allreduce's bytes on 4 ranks."""
    a = unison.algorithms.create("demo")
    assert (a.sign, a.mean, a.topk, a.chunk, a.value_bits, a._scale) == (True, "senders", 2, 64, 2, torch.bfloat16)
    n, world = 64 * 1000, 4
    ratio = (2 * (world - 1) / world * 4 * n) / ((world - 1) * message_bytes(n, 64, 2, 2, torch.bfloat16))
    assert ratio >= 20, ratio


def test_an_abandoned_round_puts_back_the_momentum_it_folded_into_and_a_completed_one_keeps_it():
    """Under fault tolerance each fold first copies what it changes (``Entry.keep``): ``undo`` (a
    membership change, before the round is done again) restores it, a shard's alone when only the
    shard was folded; ``settle`` (the round completed) keeps the fold."""
    from unison.algorithms.gradient.demo import Entry

    entry = Entry([torch.zeros(5), torch.zeros(3)], chunk=4, device=torch.device("cpu"))
    entry.flat.copy_(torch.arange(12.0))
    before = entry.flat.clone()
    entry.keep(False)
    entry.flat.mul_(0.5).add_(1.0)
    entry.undo()
    assert torch.equal(entry.flat, before)
    entry.keep(False, 4, 8)  # hierarchical: this rank's shard
    entry.flat[4:8] = -1.0
    entry.flat[0] = 7.0  # outside the shard: not this round's fold, left as it is
    entry.undo()
    assert torch.equal(entry.flat[4:8], before[4:8]) and entry.flat[0] == 7.0
    entry.keep(False)
    entry.flat.zero_()
    entry.folded = None  # what Momenta.settle does once the round completed
    entry.undo()
    assert not entry.flat.any()


def test_the_sign_with_qadams_frozen_variance_is_refused_at_construction():
    """QAdamOptimizer freezes Adam's variance after its warm-up; demo's sign steps (+-1 each) over
    it blow the weights up: refused when the wrapper is built, the direction itself accepted."""
    net = torch.nn.Linear(4, 2)
    opt = unison.QAdamOptimizer(net.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="QAdamOptimizer freezes Adam's variance"):
        unison.DataParallel(net, optimizer=opt, algorithm="demo")
    unison.DataParallel(net, optimizer=opt, algorithm="demo:sign=false").close()
