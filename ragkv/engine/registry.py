"""One registration convention for every pluggable family (fusion strategies, sparse
selectors): a Registry lists the family's dataclasses by their `name`, in the order given,
in one place (the family's registry module), and builds one from a spec string
('name:option=value,...', see ragkv.engine.spec_string).

The list is explicit rather than filled by decorators at import: the order users see
(CLI help, error messages) is written down, and nothing depends on which module happens
to be imported first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from ragkv.engine.spec_string import build_from_spec


class Registry(Mapping[str, type]):
    """Name -> class of one family; `kind` names the family in error messages ('fusion strategy')."""

    def __init__(self, kind: str, classes: Iterable[type]):
        self.kind = kind
        self._classes: dict[str, type] = {}
        for cls in classes:
            name = getattr(cls, "name", "")
            if not name or name in self._classes:
                raise ValueError(f"{kind} name {name!r} of {cls.__name__} is empty or already registered")
            self._classes[name] = cls

    def __getitem__(self, name: str) -> type:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def build(self, spec: str):
        """The registered dataclass `spec` names, its options set and validated by the class itself."""
        return build_from_spec(spec, self, self.kind)
