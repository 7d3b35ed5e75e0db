"""The hot path of the coverage: each layer call counted under its route, per live layer.

One dict lookup by route and one increment per call (``make bench-accounting`` measures it): a
route's hash is a Python call (a frozen dataclass's), so each call hashes it once, into its tally.
A trial's call (:func:`coc_inject.trial.active`) goes to a ledger of its own. A route is one of
:mod:`coc_inject.routes`' frozen dataclasses, so the totals below ask for a kind of route by its
type, never by a slot of a key.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from coc_inject.trial import active as in_trial
from coc_inject.routes import COUNTED, AttentionRoute, Chunked, Fused, MegatronPath


@dataclass
class LayerRecord:
    """One layer's calls, by route."""

    layer: weakref.ref
    cls: str
    shape: list  # [m, k, n] of its first call ([] for attention)
    tallies: dict = field(default_factory=dict)  # route -> [calls, shape of the route's first call]
    name: str | None = None

    @property
    def routes(self) -> dict:
        """{route: calls}."""
        return {route: tally[0] for route, tally in self.tallies.items()}

    def shape_for(self, route) -> list:
        """The shape of the route's first call: the one its reason speaks of."""
        return self.tallies[route][1]


def _no_shape(layer, input_) -> list:
    return []


class Ledger:
    """Calls per layer and route; a freed layer's record is kept (its id may be reused)."""

    def __init__(self):
        self.records: dict[int, LayerRecord] = {}  # by id() of the live layer
        self._retired: list[LayerRecord] = []

    def new_record(self, layer, input_, shape_of) -> LayerRecord:
        record = LayerRecord(weakref.ref(layer), type(layer).__name__, list(shape_of(layer, input_)))
        previous = self.records.get(id(layer))
        if previous is not None:  # a freed layer's id, reused: keep what it did
            self._retired.append(previous)
        self.records[id(layer)] = record
        return record

    def all_records(self) -> list:
        return self._retired + list(self.records.values())

    def calls_by_route(self) -> dict:
        """{route name: calls}, every kind named."""
        totals = {kind.name: 0 for kind in COUNTED}
        for record in self.all_records():
            for route, calls in record.routes.items():
                totals[route.name] += calls
        return totals


class Counts:
    """The job's calls per layer and route; the calls of ``auto``'s trials apart (``trials``).

    A trial runs a candidate on the job's own layers (:mod:`coc_inject.trial`): its calls are not
    the job's, so they neither add to the job's counts nor give a layer its first shape or reason.
    """

    def __init__(self):
        self.job = Ledger()
        self.trials = Ledger()

    @property
    def records(self) -> dict:
        return self.job.records

    def count(self, layer, route, input_, shape_of) -> None:
        # One function for both ledgers: this runs on every layer call.
        ledger = self.trials if in_trial() else self.job
        record = ledger.records.get(id(layer))
        if record is None or record.layer() is not layer:
            record = ledger.new_record(layer, input_, shape_of)
        tally = record.tallies.get(route)
        if tally is None:  # a route's first call on this layer: its shape, once
            record.tallies[route] = [1, record.shape if not record.tallies else list(shape_of(layer, input_))]
        else:
            tally[0] += 1

    def count_attention(self, layer, route: AttentionRoute) -> None:
        self.count(layer, route, None, _no_shape)

    def all_records(self) -> list:
        return self.job.all_records()

    def calls_by_route(self) -> dict:
        """{route name: calls} of the job, every kind named (the report's "calls")."""
        return self.job.calls_by_route()

    def trial_calls_by_route(self) -> dict:
        """{route name: calls} of auto's trials (the report's "trial_calls")."""
        return self.trials.calls_by_route()

    def routes_of(self, kind) -> dict:
        """{route: calls} over all layers, for routes of type ``kind``."""
        found: dict = {}
        for record in self.all_records():
            for route, calls in record.routes.items():
                if type(route) is kind:
                    found[route] = found.get(route, 0) + calls
        return found

    def coc_layers(self) -> int:
        return sum(1 for r in self.all_records() if any(isinstance(route, (Chunked, Fused)) for route in r.tallies))

    def any_call(self) -> bool:
        return any(r.tallies for r in self.all_records())

    def megatron_reasons(self) -> dict:
        """{reason: calls} of the calls that went to Megatron's own forward, in first-seen order."""
        return {route.reason: calls for route, calls in self.routes_of(MegatronPath).items()}
