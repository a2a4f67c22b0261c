"""Per-request KV buffers, preallocated and written in place.

transformers' DynamicCache concatenates on every decode step and so copies the whole cache
each token; here rows are written into a buffer sized for the request and grown by
doubling only when a request outgrows its estimate.

A sliding-window layer's query never sees a row more than `window - 1` positions back, so
in decode those layers may let their older rows go (`release_window_rows`): the cache then
keeps its full-attention layers in one buffer and its windowed layers in another that holds
only their last rows (`WindowRows`), so what it holds for them stops growing with the
context. Readers ask a layer for its held rows and the first row they start at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.engine.model_spec import ModelSpec


def window_slack(window: int) -> int:
    """Rows a windowed layer may hold beyond its `window - 1` before the oldest are let go:
    a block, so the shift that drops them runs once per block of decode steps."""
    return max(16, window // 4)


@dataclass
class WindowRows:
    """The windowed layers' rows [start, start + held) of a trimmed cache:
    keys/values [len(layers), kv_heads, capacity, head_dim], buffer row i = cache row start + i."""

    layers: tuple[int, ...]
    window: int
    keys: torch.Tensor
    values: torch.Tensor
    start: int


class KVCache:
    """Post-RoPE keys and values of every layer: [layers, kv_heads, capacity, head_dim].

    `length` rows are valid. `next_position` is the RoPE position of the next token; it
    equals `length` until rows are evicted (SnapKV), after which rows keep the rotation of
    the position they were computed at. Once windowed rows were released (`trimmed`), the
    all-layer `keys`/`values` no longer exist: read a layer through `held(layer)`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0, next_position: int = 0):
        self._keys, self._values = keys, values
        self.length, self.next_position = length, next_position
        self.window: WindowRows | None = None
        self._full_layers: tuple[int, ...] = tuple(range(keys.shape[0]))
        self._bind()

    @classmethod
    def allocate(cls, spec: ModelSpec, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (spec.num_layers, spec.num_kv_heads, max(capacity, 1), spec.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def _bind(self) -> None:
        """Per-layer views (keys, values, first row), rebuilt whenever a buffer is replaced."""
        layers = len(self._full_layers) + (len(self.window.layers) if self.window is not None else 0)
        views: list = [None] * layers
        for index, layer in enumerate(self._full_layers):
            views[layer] = (self._keys[index], self._values[index], False)
        if self.window is not None:
            for index, layer in enumerate(self.window.layers):
                views[layer] = (self.window.keys[index], self.window.values[index], True)
        self._views = views

    # -- the all-layer tensors (untrimmed caches) ------------------------------------

    @property
    def trimmed(self) -> bool:
        return self.window is not None

    @property
    def keys(self) -> torch.Tensor:
        self._check_whole("keys")
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        self._check_whole("values")
        return self._values

    def _check_whole(self, name: str) -> None:
        if self.window is not None:
            raise ValueError(f"a cache whose windowed layers released rows has no all-layer {name}; use held()")

    @property
    def dtype(self) -> torch.dtype:
        return self._keys.dtype

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this cache holds."""
        held = self._keys.nbytes + self._values.nbytes
        return held + (self.window.keys.nbytes + self.window.values.nbytes if self.window is not None else 0)

    # -- per layer -------------------------------------------------------------------

    def first_row(self, layer: int) -> int:
        """The first row `layer` still holds (0 unless its older rows were released)."""
        return self.window.start if self._views[layer][2] else 0

    @property
    def earliest_cut(self) -> int:
        """The fewest rows a cut (`truncate`, a prefix copy) may keep: the next token after a
        cut at `rows` needs the windowed layers' rows from rows - window + 1 on."""
        return 0 if self.window is None else self.window.start + self.window.window - 1

    def held(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`layer`'s buffers [kv_heads, capacity', head_dim] and the cache row of their row 0."""
        keys, values, windowed = self._views[layer]
        return keys, values, self.window.start if windowed else 0

    def layer(self, layer: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's held rows up to `rows` (default: all valid) rows:
        [kv_heads, rows - first_row(layer), head_dim]."""
        keys, values, first = self.held(layer)
        end = (self.length if rows is None else rows) - first
        return keys[:, :end], values[:, :end]

    def write(self, layer: int, rows: torch.Tensor | int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows (cache row indices, none before the layer's first held row) of `layer`."""
        buffer_keys, buffer_values, first = self.held(layer)
        if first:
            rows = rows - first
        buffer_keys[:, rows] = keys
        buffer_values[:, rows] = values

    # -- growing, cutting, copying ---------------------------------------------------

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in total, doubling a buffer when it must grow."""
        if rows > self.capacity:
            new_capacity = max(rows, 2 * self.capacity)
            self._keys, self._values = (_grown(old, new_capacity, self.length) for old in (self._keys, self._values))
            self._bind()
        window = self.window
        if window is not None and rows - window.start > window.keys.shape[2]:
            held = self.length - window.start
            new_capacity = max(rows - window.start, 2 * window.keys.shape[2])
            window.keys, window.values = (_grown(old, new_capacity, held) for old in (window.keys, window.values))
            self._bind()

    def truncate(self, length: int) -> None:
        """Forget rows past `length` (an exact prefix stays valid)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        if length < self.length and length < self.earliest_cut:
            raise ValueError(f"cannot cut to {length} rows: the windowed layers released rows it would need")
        self.length = length
        self.next_position = length

    def clone(self, extra_capacity: int = 0, rows: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A copy of the first `rows` (default: all valid) rows with room for `extra_capacity`
        more, in `dtype` (default: the cache's). Chat turns fork from this."""
        rows = self.length if rows is None else rows
        if rows < self.length and rows < self.earliest_cut:
            raise ValueError(f"cannot copy {rows} rows: the windowed layers released rows they would need")
        dtype = dtype or self.dtype
        copy = KVCache(
            _copied(self._keys, 0, rows, rows + extra_capacity, dtype),
            _copied(self._values, 0, rows, rows + extra_capacity, dtype),
            rows,
            self.next_position if rows == self.length else rows,
        )
        if self.window is not None:
            window = self.window
            held = rows - window.start
            copy.window = WindowRows(
                window.layers,
                window.window,
                _copied(window.keys, 0, held, held + extra_capacity, dtype),
                _copied(window.values, 0, held, held + extra_capacity, dtype),
                window.start,
            )
            copy._full_layers = self._full_layers
            copy._bind()
        return copy

    # -- as stored (a context blob) ---------------------------------------------------

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, WindowRows | None]:
        """Views of the valid rows: the full layers' (every layer's when untrimmed) keys and
        values [layers, kv_heads, length, head_dim], and the windowed layers' held rows."""
        keys, values = self._keys[:, :, : self.length], self._values[:, :, : self.length]
        window = self.window
        if window is None:
            return keys, values, None
        held = self.length - window.start
        rows = WindowRows(
            window.layers, window.window, window.keys[:, :, :held], window.values[:, :, :held], window.start
        )
        return keys, values, rows

    @classmethod
    def from_parts(
        cls, keys: torch.Tensor, values: torch.Tensor, length: int, next_position: int, window: WindowRows | None
    ) -> KVCache:
        """The cache `parts` describes (its tensors are taken, not copied)."""
        if window is None:
            return cls(keys, values, length, next_position)
        layers = keys.shape[0] + len(window.layers)
        held = length - window.start
        if window.keys.shape[2] < held or keys.shape[2] < length or not set(window.layers) <= set(range(layers)):
            raise ValueError("the windowed rows do not fit the cache's length and layers")
        cache = cls(keys, values, length, next_position)
        cache.window = window
        cache._full_layers = tuple(layer for layer in range(layers) if layer not in window.layers)
        cache._bind()
        return cache

    # -- releasing windowed rows -----------------------------------------------------

    def release_window_rows(self, layers: Sequence[int], window: int) -> None:
        """Let the windowed `layers` keep only the rows the next token's window reaches (the
        last `window - 1`), once they hold a block more than that: the first time, their
        rows move to a buffer of their own and the full layers' to a smaller one; after
        that, the last rows shift to the front of that buffer."""
        keep = window - 1
        slack = window_slack(window)
        state = self.window
        first = 0 if state is None else state.start
        if self.length - first < keep + slack or not layers:
            return
        start = self.length - keep
        if state is None:
            self._split(tuple(layers), window, start, keep + slack)
            return
        held = self.length - state.start
        if state.keys.shape[2] > keep + slack:  # a long prefill grew it: back to its steady size
            state.keys, state.values = (
                _copied(old, held - keep, held, keep + slack, old.dtype) for old in (state.keys, state.values)
            )
            self._bind()
        else:  # overlapping ranges: the source is copied first
            state.keys[:, :, :keep] = state.keys[:, :, held - keep : held].clone()
            state.values[:, :, :keep] = state.values[:, :, held - keep : held].clone()
        state.start = start

    def _split(self, layers: tuple[int, ...], window: int, start: int, capacity: int) -> None:
        full = tuple(layer for layer in range(self._keys.shape[0]) if layer not in layers)
        self.window = WindowRows(
            layers,
            window,
            *(_gathered(old, layers, start, self.length, capacity) for old in (self._keys, self._values)),
            start,
        )
        self._keys, self._values = (
            _gathered(old, full, 0, self.length, self.capacity) for old in (self._keys, self._values)
        )
        self._full_layers = full
        self._bind()

    # -- snapshots of the tail (a chat turn that may fail) ----------------------------

    @torch.inference_mode()  # decode may have made the buffers inference tensors
    def tail(self, start: int, window: int | None = None) -> Tail:
        """A copy of rows [start, length), from up to `window - 1` rows earlier where the
        windowed layers still hold them (what the next token after `length` reads), for
        `restore` after a turn wrote and decoded past `start`."""
        back = start if window is None else min(start, max(self.length - window + 1, 0))
        back = max(back, self.window.start if self.window is not None else 0)
        shape = (len(self._views), self._keys.shape[1], self.length - back, self._keys.shape[3])
        keys, values = self._keys.new_empty(shape), self._values.new_empty(shape)
        for layer in range(len(self._views)):
            buffer_keys, buffer_values, first = self.held(layer)
            keys[layer], values[layer] = (
                buffer_keys[:, back - first : self.length - first],
                buffer_values[:, back - first : self.length - first],
            )
        return Tail(back, keys, values, self.next_position)

    @torch.inference_mode()  # decode may have made the buffers inference tensors
    def restore(self, tail: Tail) -> None:
        """Put back the rows `tail` copied; the rows before them were never written since
        (a turn writes after its kept rows), and the turn's own rows are forgotten."""
        length = tail.start + tail.keys.shape[2]
        self.reserve(length)
        window = self.window
        if window is not None and window.start > tail.start:  # the turn released rows the tail holds
            capacity = length - tail.start + window_slack(window.window)
            window.keys, window.values = (
                old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:]) for old in (window.keys, window.values)
            )
            window.start = tail.start
            self._bind()
        rows = torch.arange(tail.start, length, device=self._keys.device)
        for layer in range(len(self._views)):
            self.write(layer, rows, tail.keys[layer], tail.values[layer])
        self.length, self.next_position = length, tail.next_position


@dataclass
class Tail:
    """Rows [start, start + rows) of every layer: keys/values [layers, kv_heads, rows, head_dim]."""

    start: int
    keys: torch.Tensor
    values: torch.Tensor
    next_position: int


def _gathered(old: torch.Tensor, layers: Sequence[int], start: int, end: int, capacity: int) -> torch.Tensor:
    """Rows [start, end) of `layers` of `old` at the front of a new buffer of `capacity` rows."""
    out = old.new_empty((len(layers), old.shape[1], max(capacity, end - start, 1), old.shape[3]))
    for index, layer in enumerate(layers):
        out[index, :, : end - start] = old[layer, :, start:end]
    return out


def _grown(old: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    grown = old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:])
    grown[:, :, :rows] = old[:, :, :rows]
    return grown


def _copied(old: torch.Tensor, start: int, end: int, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, end) of `old` at the front of a new buffer of `capacity` rows."""
    copy = old.new_empty(old.shape[:2] + (max(capacity, end - start, 1),) + old.shape[3:], dtype=dtype)
    copy[:, :, : end - start] = old[:, :, start:end]
    return copy
