"""The probe's attention pass against plain references: the output equals the torch
reference of selective attention, and the column masses are the softmax probabilities
summed explicitly, whether the rows fit one block or are split into many."""

from __future__ import annotations

import pytest
import torch

from ragkv.fusion import probe
from ragkv.kernels.reference import selective_attention


@pytest.mark.parametrize("block_bytes", [probe.PROBABILITY_BYTES, 4 * 9 * 100 * 7])
def test_attention_with_column_mass_matches_the_references(monkeypatch, block_bytes):
    monkeypatch.setattr(probe, "PROBABILITY_BYTES", block_bytes)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(9, 40, 16, generator=generator)
    keys, values = torch.randn(3, 100, 16, generator=generator), torch.randn(3, 100, 16, generator=generator)
    positions = torch.arange(60, 100)
    attention, mass, last_row = probe.attention_with_column_mass(q, keys, values, positions, 0.25)
    torch.testing.assert_close(attention, selective_attention(q, keys, values, positions, 0.25), atol=1e-5, rtol=1e-5)
    logits = torch.einsum("hnd,htd->hnt", q, keys.repeat_interleave(3, dim=0)) * 0.25
    visible = torch.arange(100)[None, :] <= positions[:, None]
    probabilities = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    torch.testing.assert_close(mass, probabilities.sum(dim=(0, 1)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last_row, probabilities[:, -1].sum(dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 30])
def test_column_mass_over_a_subset_of_columns_and_a_window(window):
    """Columns at given positions (a long prefix's middle left out) and a sliding window:
    the masses are the explicit softmax over the visible columns."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(4, 12, 16, generator=generator)
    columns = torch.cat((torch.arange(4), torch.arange(50, 120)))
    keys = torch.randn(2, columns.numel(), 16, generator=generator)
    values = torch.randn(2, columns.numel(), 16, generator=generator)
    positions = torch.arange(108, 120)
    attention, mass, last_row = probe.attention_with_column_mass(q, keys, values, positions, 0.3, window, columns)
    logits = torch.einsum("hnd,htd->hnt", q, keys.repeat_interleave(2, dim=0)) * 0.3
    visible = columns[None, :] <= positions[:, None]
    if window is not None:
        visible &= columns[None, :] > positions[:, None] - window
    probabilities = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    expected = torch.einsum("hnt,htd->hnd", probabilities, values.repeat_interleave(2, dim=0))
    torch.testing.assert_close(attention, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, probabilities.sum(dim=(0, 1)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last_row, probabilities[:, -1].sum(dim=0), atol=1e-5, rtol=1e-5)
