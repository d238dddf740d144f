"""Adapter tiers: CPU LRU, GPU slots, pinning, in-flight protection, counters."""

from __future__ import annotations

import pytest
import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.lora.registry import AdapterConflict, AdapterNotFound, AdapterRegistry
from lorafleet.worker.lora.slots import LoraSlots


@pytest.fixture
def make_registry(demo_model):
    model = ModelConfig.from_folder(demo_model)

    def make(max_loras=2, max_cpu_loras=3) -> AdapterRegistry:
        cfg = EngineConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_loras_per_request=1)
        slots = LoraSlots(model, max_loras, cfg.max_lora_rank, torch.device("cpu"), torch.float32)
        return AdapterRegistry(model, cfg, slots, torch.float32)

    return make


def register(reg: AdapterRegistry, adapters, *names, pinned=False):
    for n in names:
        reg.register(n, reg.read(str(adapters[n])), pinned=pinned)


def test_cpu_cache_is_lru_and_counts(make_registry, demo_adapters):
    reg = make_registry(max_loras=2, max_cpu_loras=3)
    register(reg, demo_adapters, "sql", "chat", "poem")
    reg.ensure_cpu("sql")  # sql becomes most recently used
    register(reg, demo_adapters, "code")  # evicts chat, the least recently used
    assert list(reg.cpu) == ["poem", "sql", "code"]
    assert reg.tier("chat") == "disk" and reg.stats.cpu_evictions == 1
    reg.ensure_cpu("chat")  # read back from disk: a miss
    assert reg.stats.cpu_misses == 1 and reg.tier("chat") == "cpu"
    assert reg.stats.cpu_hits == 1


def test_gpu_slots_lru_and_protection(make_registry, demo_adapters):
    reg = make_registry(max_loras=2, max_cpu_loras=4)
    register(reg, demo_adapters, "sql", "chat", "poem")
    reg.activate(["sql"], {"sql"})
    reg.activate(["chat"], {"chat"})
    assert sorted(reg.gpu_resident()) == ["chat", "sql"]
    reg.activate(["poem"], {"poem", "chat"})  # chat protected by the running batch: sql goes
    assert sorted(reg.gpu_resident()) == ["chat", "poem"]
    assert reg.tier("sql") == "cpu" and reg.stats.gpu_evictions == 1
    assert reg.stats.gpu_misses == 3
    reg.activate(["poem"], {"poem"})
    assert reg.stats.gpu_hits == 1


def test_slot_holds_true_rank_and_folded_scale(make_registry, demo_adapters):
    reg = make_registry()
    register(reg, demo_adapters, "legal")  # r=8, up_proj r=2 via rank_pattern, alpha 8
    slot = reg.activate(["legal"], {"legal"})["legal"]
    layer = reg.slots.layers[0]
    assert layer["qkv_proj"].ranks[0][slot] == 8
    assert layer["qkv_proj"].ranks[1][slot] == 0  # k_proj not targeted: no work
    assert layer["gate_up_proj"].ranks[1][slot] == 2  # the rank pattern
    weights = reg.read(str(demo_adapters["legal"]))
    m = weights.modules[(0, "q_proj")]
    want_b = m.b * (8 / 8)
    torch.testing.assert_close(layer["qkv_proj"].lora_b[0][slot, :, :8], want_b)
    m_up = weights.modules[(0, "up_proj")]
    torch.testing.assert_close(layer["gate_up_proj"].lora_b[1][slot, :, :2], m_up.b * (8 / 2))


def test_in_flight_and_pinned_are_never_evicted(make_registry, demo_adapters):
    reg = make_registry(max_loras=2, max_cpu_loras=2)
    register(reg, demo_adapters, "sql", pinned=True)
    register(reg, demo_adapters, "chat")
    reg.acquire(["chat"])  # a request in flight
    register(reg, demo_adapters, "poem")  # over capacity, but nothing may go
    assert set(reg.cpu) == {"sql", "chat", "poem"}
    reg.release(["chat"])
    register(reg, demo_adapters, "code")
    assert "sql" in reg.cpu and "chat" not in reg.cpu  # chat was LRU and free to go
    # GPU: the pinned adapter keeps its slot.
    reg.activate(["sql"], {"sql"})
    reg.activate(["poem"], {"poem"})
    reg.activate(["code"], {"code"})
    assert "sql" in reg.gpu_resident()


def test_loading_a_disk_tier_adapter_again_makes_it_resident(make_registry, demo_adapters):
    """The same content again is no new entry, but the load asked for it resident: a disk-tier entry
    stayed on disk, and the operator, which verifies a load by the inventory's tier, retried for ever."""
    reg = make_registry(max_loras=2, max_cpu_loras=2)
    register(reg, demo_adapters, "sql", "chat", "poem")
    assert reg.tier("sql") == "disk"
    _, created = reg.register("sql", reg.read(str(demo_adapters["sql"])))
    assert not created and reg.tier("sql") == "cpu"


def test_same_content_is_idempotent_and_different_content_conflicts(make_registry, demo_adapters):
    reg = make_registry()
    register(reg, demo_adapters, "sql")
    _, created = reg.register("sql", reg.read(str(demo_adapters["sql"])))
    assert not created
    with pytest.raises(AdapterConflict):
        reg.register("sql", reg.read(str(demo_adapters["chat"])))


def test_unload_with_requests_in_flight_drains(make_registry, demo_adapters):
    reg = make_registry()
    register(reg, demo_adapters, "sql")
    reg.acquire(["sql"])
    reg.activate(["sql"], {"sql"})
    reg.unregister("sql")
    with pytest.raises(AdapterNotFound):
        reg.acquire(["sql"])  # new requests no longer find it
    assert "sql" in reg.cpu  # the request in flight still computes with it
    reg.release(["sql"])
    assert "sql" not in reg.cpu and "sql" not in reg.entries and reg.gpu_resident() == []


def test_prefetch_uses_only_free_or_idle_slots(make_registry, demo_adapters):
    reg = make_registry(max_loras=2, max_cpu_loras=4)
    register(reg, demo_adapters, "sql", "chat", "poem")
    reg.activate(["sql"], {"sql"})
    assert reg.prefetch(["chat", "poem"], protected={"sql"}) == ["chat"]  # poem: only sql's slot, protected
    assert sorted(reg.gpu_resident()) == ["chat", "sql"]


def test_pinned_adapters_give_up_gpu_slots_when_a_batch_needs_them(make_registry, demo_adapters):
    reg = make_registry(max_loras=2, max_cpu_loras=4)
    register(reg, demo_adapters, "sql", "chat", pinned=True)
    register(reg, demo_adapters, "poem")
    reg.activate(["sql"], {"sql"})
    reg.activate(["chat"], {"chat"})
    # Prefetch is optional: it never takes a pinned adapter's slot.
    assert reg.prefetch(["poem"], protected=set()) == []
    # A batch the scheduler admitted must run: the least recently used pinned slot is given up.
    slots = reg.activate(["poem"], {"poem"})
    assert set(reg.gpu_resident()) == {"chat", "poem"} and slots["poem"] == 0
    assert "sql" in reg.cpu  # pinning keeps it in host memory for good
    for name in ("code", "legal"):
        register(reg, demo_adapters, name)
    assert "sql" in reg.cpu and "chat" in reg.cpu


def test_reloading_a_draining_name(make_registry, demo_adapters):
    reg = make_registry()
    register(reg, demo_adapters, "sql")
    reg.acquire(["sql"])
    reg.unregister("sql")
    # Different content while requests still run with the old weights: refused, nothing changes.
    with pytest.raises(AdapterConflict) as info:
        reg.register("sql", reg.read(str(demo_adapters["chat"])))
    assert info.value.reason == "draining"
    assert reg.entries["sql"].in_flight == 1 and reg.entries["sql"].removed
    # The same content takes the unload back.
    _, created = reg.register("sql", reg.read(str(demo_adapters["sql"])))
    assert not created and reg.get("sql").in_flight == 1
    reg.release(["sql"])
    assert reg.get("sql").in_flight == 0
    with pytest.raises(RuntimeError, match="released more often"):
        reg.release(["sql"])


def test_latest_layouts_stay_on_the_gpu_until_their_first_fill(make_registry, demo_adapters, monkeypatch):
    """The last GPU_COPIES_KEPT adapters read keep the GPU copy of their layout (a GPU read leaves
    one; faked here with copies on the pool's own device) until a fill takes it, newer reads push
    it out, the byte cap refuses it, or the adapter leaves the CPU cache; a fill copies from it,
    not from the host buffers."""
    from lorafleet.worker.lora import registry as registry_mod

    reg = make_registry(max_loras=2, max_cpu_loras=4)
    real_read = reg.read

    def read(path):
        weights = real_read(path)
        weights.packed.gpu_sources = [s.clone() for s in weights.packed.sources]
        return weights

    monkeypatch.setattr(reg, "read", read)

    def kept():
        return [n for n, w in reg.cpu.items() if w.packed.gpu_sources is not None]

    register(reg, demo_adapters, "sql", "chat", "poem")
    assert kept() == ["chat", "poem"]
    packed = reg.cpu["poem"].packed
    host = [c.clone() for c in packed.chunks]
    for c in packed.chunks:
        c.fill_(float("nan"))  # the host buffers not there yet: the fill must not read them
    slot = reg.activate(["poem"], {"poem"})["poem"]
    assert kept() == ["chat"]
    filled = [t[:, slot].clone() for pair in reg.slots._storage for t in pair]
    for c, h in zip(packed.chunks, host):
        c.copy_(h)
    reg.offload("poem")
    assert reg.activate(["poem"], {"poem"})["poem"] == slot  # again, from the host buffers this time
    assert all(torch.equal(a, t[:, slot]) for a, t in zip(filled, (t for pair in reg.slots._storage for t in pair)))
    reg.unregister("chat")
    assert kept() == []
    register(reg, demo_adapters, "chat", "code")
    assert kept() == ["chat", "code"]
    monkeypatch.setattr(registry_mod, "GPU_COPIES_KEPT_BYTES", reg.cpu["code"].packed.nbytes)
    register(reg, demo_adapters, "legal")  # evicts sql from the CPU cache; only the latest fits the cap
    assert "sql" not in reg.cpu and kept() == ["legal"]
