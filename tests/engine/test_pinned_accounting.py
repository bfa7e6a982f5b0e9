"""Hypothesis: pinned-block accounting through the engine (simulated executor: the scheduler and
block manager run for real). Random pins (prefixes sharing blocks, whole or ending inside a block,
two salts), requests that share them or not, and floods that evict the cache (to the host tier
when there is one), against a model of the pins: the distinct pinned blocks are the pins' distinct
full-block prefixes plus their partial tails.

After every operation the engine is idle and: the pinned blocks are counted once
(`num_pinned_blocks`, `kv_stats()`, the /metrics gauge, and the blocks actually referenced all
agree with the model); every other block is free; a request is refused exactly when it cannot fit
(its blocks, less the pinned ones it shares, more than the unpinned pool) and otherwise runs to its
end; a pin succeeds whenever its prefix fits, and a refused one changes nothing.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.serve.metrics import PrometheusObserver
from tests.engine.test_pinned_prefixes import BS, sim_engine

NUM_USABLE = 13  # num_blocks=14
MAX_LEN = 64
BASE = list(range(1, 29))  # 7 blocks of tokens that prefixes share
SALTS = (None, "tenant")

prefix_ops = st.tuples(st.just("pin"), st.integers(1, len(BASE)), st.lists(st.sampled_from([30, 31]), max_size=2),
                       st.sampled_from(SALTS))
request_ops = st.tuples(st.just("request"), st.integers(0, len(BASE)), st.lists(st.integers(32, 40), max_size=30),
                        st.sampled_from(SALTS))
flood_ops = st.tuples(st.just("flood"), st.integers(1, 3), st.integers(8, 40), st.just(None))


class PinModel:
    """The pins as sets of keys: each distinct full-block prefix and each partial tail is one block."""

    def __init__(self):
        self.prefixes: set[tuple] = set()
        self.full: set[tuple] = set()  # (salt, tokens of k whole blocks)
        self.tails: set[tuple] = set()  # (salt, tokens of a prefix ending inside a block)

    @property
    def num_blocks(self) -> int:
        return len(self.full) + len(self.tails)

    def add(self, salt, prefix):
        self.prefixes.add((salt, tuple(prefix)))
        self.full |= {(salt, tuple(prefix[: k * BS])) for k in range(1, len(prefix) // BS + 1)}
        if len(prefix) % BS:
            self.tails.add((salt, tuple(prefix)))

    def shared(self, salt, prompt) -> int:
        """Pinned whole blocks a prompt maps (a match never covers its last token)."""
        k = 0
        while k < (len(prompt) - 1) // BS and (salt, tuple(prompt[: (k + 1) * BS])) in self.full:
            k += 1
        return k

    def fits(self, salt, prompt) -> bool:
        need = -(-(len(prompt) + 1) // BS)
        return len(prompt) < MAX_LEN and need - self.shared(salt, prompt) <= NUM_USABLE - self.num_blocks


def check_accounting(engine, observer, model):
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished()
    engine.step()  # (an idle step: the observer reads the engine)
    held = {b for b in range(1, bm.num_blocks) if bm.refcount[b] > 0}
    stats = engine.kv_stats()
    gauge = observer.registry.get_sample_value("jpaged:pinned_prefix_blocks", {"model_name": "m", "engine": "0"})
    assert bm.num_pinned_blocks == stats["num_pinned_blocks"] == gauge == len(held) == model.num_blocks
    assert stats["num_free_blocks"] == NUM_USABLE - model.num_blocks
    pins_of = {}
    for blocks in bm.pinned.values():
        for b in blocks:
            pins_of[b] = pins_of.get(b, 0) + 1
    assert {b: int(bm.refcount[b]) for b in held} == pins_of  # one reference per pin, nothing else


@settings(max_examples=60, deadline=None)
@given(tier=st.sampled_from([0, 6]), ops=st.lists(st.one_of(prefix_ops, request_ops, flood_ops), min_size=1,
                                                    max_size=10))
def test_pinned_blocks_are_counted_once_and_requests_refused_only_when_they_cannot_fit(tier, ops):
    engine = sim_engine(num_host_cache_blocks=tier, max_model_len=MAX_LEN)
    observer = PrometheusObserver("m")
    observer.attach(engine)
    bm, model = engine.scheduler.block_manager, PinModel()
    for n, (kind, a, b, salt) in enumerate(ops):
        if kind == "pin":
            prefix = BASE[:a] + b
            nodes = bm.prefix_cache.path([tuple(prefix[i:i + BS]) for i in range(0, len(prefix) // BS * BS, BS)],
                                         salt)
            held = (salt, tuple(prefix)) in model.prefixes or (
                len(prefix) % BS == 0 and len(nodes) == len(prefix) // BS and not any(x.on_host for x in nodes))
            computed = engine.num_prefill_tokens
            try:
                assert engine.pin_prefix(prefix, salt) == -(-len(prefix) // BS)
            except ValueError:
                assert not held and not model.fits(salt, prefix), f"pin of {len(prefix)} tokens refused"
            else:
                assert held or model.fits(salt, prefix)
                if held:  # pinned as the cache holds it: nothing computed
                    assert engine.num_prefill_tokens == computed
                model.add(salt, prefix)
        else:
            prompts = ([BASE[:a] + b] if kind == "request" else
                       [[41 + (17 * n + 5 * i + t) % 200 for t in range(b)] for i in range(a)])  # (vocabulary: 256)
            if not prompts[0]:
                continue
            accepted = []
            for i, prompt in enumerate(prompts):
                try:
                    engine.add_request(f"{n}-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                       cache_salt=salt)
                except ValueError as err:
                    assert "KV blocks" in str(err) or "max_model_len" in str(err)
                    assert not model.fits(salt, prompt), f"refused though it fits: {err}"
                else:
                    assert model.fits(salt, prompt), f"a prompt of {len(prompt)} tokens accepted though it cannot fit"
                    accepted.append(f"{n}-{i}")
            finished = {}
            while engine.has_unfinished():
                finished.update({o.request_id: o for o in engine.step() if o.finished})
            assert sorted(finished) == sorted(accepted)
            assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in finished.values())
        check_accounting(engine, observer, model)
