"""The leases of HTTP users' training runs belong to those users: their view, their limits; the kernel only
drives them. `user_metadata` may name the lease (`openrl_lease`), the group (`openrl_group`) and a quota."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from openrl_lab.identity import KERNEL_USER
from openrl_lab.orchestrator import TimeSliceOrchestratorClient

from ..conftest import make_key
from .helpers import MODEL, TEXTS, sft_batch


def test_a_training_runs_lease_is_its_users(lab):
    ann_key, ben_key = make_key(lab.home, "ann"), make_key(lab.home, "ben")
    ann = tinker.ServiceClient(base_url=lab.base_url, api_key=ann_key)
    ben = tinker.ServiceClient(base_url=lab.base_url, api_key=ben_key)
    ann_orch = TimeSliceOrchestratorClient(lab.grpc_target, api_key=ann_key, job="probe")
    ben_orch = TimeSliceOrchestratorClient(lab.grpc_target, api_key=ben_key, job="probe")
    try:
        named = ann.create_lora_training_client(
            base_model=MODEL,
            rank=8,
            seed=1,
            user_metadata={
                "openrl_lease": "ann-sft",
                "openrl_group": "trainer-group",
                "openrl_priority": "interactive",
            },
        ).result()
        plain = ann.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
        batch = sft_batch(named.get_tokenizer(), TEXTS[:2])
        named.forward_backward(batch, "cross_entropy").result()
        plain.forward_backward(batch, "cross_entropy").result()
        sampler = named.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()

        leases = {L.name: L for L in ann_orch.leases()}
        assert set(leases) == {"ann-sft", plain.model_id}  # named by openrl_lease, else after the model
        assert {(L.owner, L.driven_by, L.group_id) for L in leases.values()} == {("ann", KERNEL_USER, "default")}
        assert ben_orch.leases() == []
        # an SDK run is batch unless its metadata asks for interactive
        assert {n: L.priority for n, L in leases.items()} == {"ann-sft": "interactive", plain.model_id: "batch"}
        # The phases of the run (the sampler made from its weights included) ran under ann's lease; ben sees
        # them on the shared timeline without their names.
        kinds = {r.kind for r in ann_orch.timeline("default", limit=100_000).records if r.job == "ann-sft" and r.mine}
        assert {"create_model", "forward_backward", "save_weights_for_sampler", "sample"} <= kinds
        theirs = [r for r in ben_orch.timeline("default", limit=100_000).records if r.kind == "sample" and not r.mine]
        assert theirs and all(r.job == "" for r in theirs)

        # A quota on the run's lease is enforced: past it, the run's next phase is refused with a user error.
        capped = ben.create_lora_training_client(
            base_model=MODEL, rank=8, seed=3, user_metadata={"openrl_quota_s": "0.000001"}
        ).result()
        assert [L.quota_s for L in ben_orch.leases()] == [1e-6]
        with pytest.raises(Exception, match="has used its quota"):
            capped.forward_backward(batch, "cross_entropy").result()
    finally:
        ann_orch.close()
        ben_orch.close()
        ann.close("success").result()
        ben.close("success").result()


def test_bad_time_slicing_metadata_is_a_400_at_create_time(lab, service):
    with pytest.raises(
        tinker.BadRequestError,
        match="openrl_group 'gpu-9' is not a group of this server; "
        "groups: default \\(aliases trainer-group, sampler-group\\)",
    ):
        service.create_lora_training_client(base_model=MODEL, rank=8, user_metadata={"openrl_group": "gpu-9"}).result()
    with pytest.raises(tinker.BadRequestError, match="openrl_lease 'two words' is not a lease name"):
        service.create_lora_training_client(
            base_model=MODEL, rank=8, user_metadata={"openrl_lease": "two words"}
        ).result()
    with pytest.raises(tinker.BadRequestError, match="openrl_weight '-1' must be a finite number > 0"):
        service.create_lora_training_client(base_model=MODEL, rank=8, user_metadata={"openrl_weight": "-1"}).result()
    with pytest.raises(tinker.BadRequestError, match="openrl_priority 'high' must be one of interactive, batch"):
        service.create_lora_training_client(
            base_model=MODEL, rank=8, user_metadata={"openrl_priority": "high"}
        ).result()
