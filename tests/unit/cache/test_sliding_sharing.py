"""A sliding layer on batched-sequence is laid out flat, its rows shared by clones, until its sequence
writes past the ring's slots; it then becomes a private ring. Every read is checked against naive
attention over the true history (the harness); the sharing by the pieces' blocks and the capacity."""

from __future__ import annotations

import numpy as np

from tests.unit.cache.harness import TOL, Driver, geometry

SLOTS = 4 + 3  # the harness's window 4 + max_write 3


def test_a_clone_before_the_wrap_shares_the_sliding_rows() -> None:
    d = Driver("batched-sequence", geometry(3, initial=8))
    src = d.new()
    d.fill(src, 6)
    fork = d.clone(src, 5)
    donor, forked = d.cache.sequence(src), d.cache.sequence(fork)
    # one frozen piece both read on both layers; neither holds a private copy of the sliding rows
    assert donor.pieces[0].block is forked.pieces[0].block
    assert all(p.keys[1] is not None for p in (*donor.pieces, *forked.pieces))
    assert forked.buffers(1)[0] is None and not forked.wrapped
    assert d.cache.used() == 6  # each layer's 6 rows once (a copied ring would make it (6 + 11) / 2)
    assert d.probe(fork) < TOL and d.probe(src) < TOL
    assert d.fill(fork, 1) < TOL and d.fill(src, 1) < TOL  # both still flat-laid: 6 and 7 <= 7 slots
    assert not forked.wrapped and not donor.wrapped


def test_the_step_past_the_slots_makes_a_private_ring_and_the_clone_reads_on() -> None:
    d = Driver("batched-sequence", geometry(3, initial=8))
    src = d.new()
    d.fill(src, 6)
    fork = d.clone(src, 6)
    shared = d.cache.sequence(src).pieces[0].keys[1]
    assert d.step({src: 3}) < TOL  # positions 6..8: past the 7 slots, the source's layer 1 wraps
    donor = d.cache.sequence(src)
    assert donor.wrapped and donor.is_ring(1) and donor.buffers(1)[0].shape[1] == SLOTS
    assert all(p.keys[1] is None for p in donor.pieces)  # its pieces no longer view the ring's rows
    # the fork still reads the shared rows, unchanged, and wraps on its own later
    forked = d.cache.sequence(fork)
    np.testing.assert_array_equal(np.array(forked.pieces[0].keys[1]), np.array(shared))
    assert d.probe(fork) < TOL and d.probe(src) < TOL
    assert d.fill(fork, 9, chunk=3) < TOL and d.cache.sequence(fork).wrapped
    assert d.fill(src, 5, chunk=1) < TOL and d.probe(src) < TOL and d.probe(fork) < TOL
    # a clone of a wrapped sequence copies its ring and keeps the floor
    late = d.clone(src, d.cache.pos(src))
    assert late is not None and d.cache.sequence(late).wrapped and d.probe(late) < TOL


def test_negative_control_a_flat_laid_layer_without_its_window_reads_too_much() -> None:
    # The window must still hide rows once the flat-laid sliding layer holds more than W positions:
    # the same 6-row history read as a flat layer (no window) differs from the windowed reference.
    d = Driver("batched-sequence", geometry(3, initial=8))
    src = d.new()
    assert d.fill(src, 6) < TOL
    flat = Driver("batched-sequence", geometry(3, initial=8, ring=False))
    other = flat.new()
    rows = np.stack(d.history[src])[None]  # replay the same rows into an all-flat cache
    for i in range(6):
        flat.step({other: 1}, rows[:, i], np.zeros((1, 2, *rows.shape[-2:]), np.float32))
    q = np.random.default_rng(3).standard_normal((1, 2, *rows.shape[-2:])).astype(np.float32)
    probe_row = np.random.default_rng(4).standard_normal((1, 2, 2, *rows.shape[-2:])).astype(np.float32)
    d.step({src: 1}, probe_row, q)
    flat.step({other: 1}, probe_row, q)
    assert np.abs(d.last[0, 1] - flat.last[0, 1]).max() > 1e-3  # sliding window 4 vs all 7 rows
