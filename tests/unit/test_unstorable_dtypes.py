"""A dtype the shard format cannot store fails ``save()`` with its key path (#12, finding 10)."""

from __future__ import annotations

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, StateEncodingError
from lm_resiliency.capture.engine import CaptureEngine
from lm_resiliency.experimental import InMemoryCheckpointManager

torch.set_num_threads(1)

_UNSTORABLE = [torch.complex128] + (
    [torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []
)


@pytest.mark.parametrize("dtype", _UNSTORABLE, ids=str)
def test_save_refuses_the_dtype_on_the_callers_thread_naming_the_key_path(
    dtype: torch.dtype,
) -> None:
    good = {"model": {"w": torch.ones(4)}, "step": 1}
    bad = {"model": {"w": torch.ones(4), "rope": {"freqs": torch.zeros(3, dtype=dtype)}}}
    cfg = InMemoryCkptConfig(interval=1, disk_flush_interval=1, signal_flush=False)
    with InMemoryCheckpointManager(cfg) as manager:
        with pytest.raises(StateEncodingError) as info:
            manager.save(bad, 1)
        msg = str(info.value)
        assert "'model/rope/freqs'" in msg and str(dtype) in msg
        assert "float32" in msg  # the dtypes that work are listed
        assert manager.find_latest() is None  # nothing was captured
        manager.save(good, 2)  # the manager is still usable afterwards
        manager.maybe_wait()
        assert manager.wait_persisted(30)
        assert manager.find_latest() == 2
        assert list(manager.store().topology_path.glob("step-2/rank-0.safetensors"))


def test_the_mtgs_shadow_path_still_captures_any_dtype() -> None:
    engine = CaptureEngine(pin_memory=False, num_slots=1)  # capture_tensors: never persisted
    try:
        z = torch.randn(3, dtype=torch.complex128)
        engine.capture_tensors([z], ["z"], step=1)
        engine.wait_idle()
        (view,) = engine.current.views()
        assert torch.equal(view, z)
    finally:
        engine.close()
