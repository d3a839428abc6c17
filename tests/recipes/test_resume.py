"""An RL run survives the server restarting between steps: it resumes from its last save_state."""

from __future__ import annotations

import pytest
import tinker

from openrl_lab.recipes import RLConfig, rl_train
from openrl_lab.server import LabServer

from .helpers import Spread

pytestmark = pytest.mark.server  # starts a lab it restarts


def test_rl_run_resumes_from_its_last_save_state_after_a_server_restart(tmp_path):
    with LabServer(tmp_path / "home") as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=16, seed=0).result()
        seen = []

        def restart_after_step_3(step, row):
            seen.append((step, row["reward"], row["shaped_reward"]))
            if step == 3 and len(seen) == 3:  # once: stop the server and start it again (same home and port)
                lab.stop()
                lab.start()

        # with a KL penalty: its reference (a training client on the weights RL started from) is lost too
        config = RLConfig(
            steps=5,
            prompts_per_step=2,
            group_size=8,
            max_tokens=4,
            learning_rate=1e-2,
            kl_coef=0.1,
            save_every=2,
            seed=0,
        )
        with pytest.warns(UserWarning, match="no longer holds the model.*resuming from tinker://"):
            result = rl_train(service, trainer, Spread(), config, on_step=restart_after_step_3, progress=False)
        # the model was gone at step 4; the run went back to the state saved after step 2 and redid step 3
        assert [s for s, *_ in seen] == [1, 2, 3, 3, 4, 5]
        assert len(result.resumes) == 1
        assert result.resumes[0]["at_step"] == 4 and result.resumes[0]["from_step"] == 2
        assert result.resumes[0]["path"] == result.checkpoints[1]
        assert [p.rsplit("/", 1)[-1] for p in result.checkpoints] == ["rl-step-00000", "rl-step-00002", "rl-step-00004"]
        assert list(result.metrics["step"]) == [1, 2, 3, 4, 5]
        assert (result.metrics["trained_samples"] > 0).all()
        assert result.metrics["ref_kl"].notna().all()  # the reference was found again after the restart
        assert result.training_client.model_id != trainer.model_id
        # same weights and optimizer, same prompts and sampling seeds: the redone step 3 sampled the same
        assert seen[3][1:] == pytest.approx(seen[2][1:])
        service.close("success").result()
