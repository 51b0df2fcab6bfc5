"""The C++ gated delta rule (csrc/delta_rule.cpp) against the torch recurrence of model/delta_net.py:
a step of several items (prefill chunks from zeros and from a state, single tokens) at once equals
each item run through the torch reference alone, for 1 and 2 threads; bad calls are refused."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu_extension import loaded_or_explained
from radixserve.model.attention import AttentionMetadata
from radixserve.model.delta_net import GatedDeltaNet
from radixserve.model.spec import DeltaNetSpec
from radixserve.model.state_cache import StateCache, StateLayout

pytestmark = pytest.mark.skipif(loaded_or_explained() is None, reason="the C++ extension does not build here")


class _Spec:
    hidden_size = 48
    rms_norm_eps = 1e-6


def _layer(d: DeltaNetSpec, seed: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(_Spec(), d, 0)  # type: ignore[arg-type]
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3)
    return layer


def _meta(query_lens: list[int], starts: list[int], slots: list[int]) -> AttentionMetadata:
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    return AttentionMetadata(slot_mapping=torch.zeros(0), cu_seqlens_q=torch.zeros(0), seq_lens=torch.zeros(0),
                             block_table=torch.zeros(0), query_lens=query_lens, seq_lens_host=seq_lens,
                             state_slots=slots)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_kernel_equals_the_torch_recurrence(threads: int, heads: tuple[int, int]) -> None:
    d = DeltaNetSpec(heads[0], heads[1], 8, 12, 4)
    layer = _layer(d, seed=heads[1])
    layout = StateLayout((d,), torch.float32)
    kernel_states, torch_states = StateCache(layout, 4, torch.device("cpu")), StateCache(layout, 4, torch.device("cpu"))
    for states in (kernel_states, torch_states):  # every slot holds the same stale state: fresh items ignore theirs
        torch.manual_seed(7)
        states.conv[0].normal_()
        states.ssm[0].normal_(0.0, 0.1)
    x = torch.randn(1 + 9 + 5 + 1, _Spec.hidden_size)
    meta = _meta([1, 9, 5, 1], [0, 0, 6, 3], [0, 1, 2, 3])  # a fresh token, a fresh chunk, a resumed chunk, a token
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            layer.implementation = "cpp"
            got = layer(x, kernel_states, meta)
            layer.implementation = "torch"
            want = layer(x, torch_states, meta)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_states.ssm[0], torch_states.ssm[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_states.conv[0], torch_states.conv[0])


def test_two_items_on_one_slot_are_refused() -> None:
    q = torch.zeros(2, 2, 8)
    v = torch.zeros(2, 2, 12)
    states = torch.zeros(3, 2, 8, 12)
    with pytest.raises(RuntimeError, match="belongs to two items"):
        torch.ops.radixserve.gated_delta_rule(q, q, v, torch.zeros(2, 2), torch.zeros(2, 2), states, [1, 1], [1, 1],
                                              [0, 0], torch.empty(2, 2, 12))
