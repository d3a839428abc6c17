"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis: valid and invalid inputs) against a real
server: whatever a client sends, the answer is never a 5xx, never an empty 4xx, and never shows where the
server keeps its files. Half of the cases carry ids of objects that exist (a session, a model, a checkpoint,
a lab lease), so the fuzzed values reach past the ownership checks."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from ..conftest import running_lab
from .test_wire_and_bad_input import Api

pytestmark = pytest.mark.server  # starts a lab of its own (LabServer)

EXAMPLES_PER_OPERATION = 120  # about half a minute for the whole API here, a minute on a busy machine
# forward_backward's body is protobuf: the fuzzer sends it bytes, as for any binary body
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")


@pytest.fixture(scope="module")
def fuzz_lab(tmp_path_factory):
    """A server of its own: the fuzzer's sessions and leases stay out of the other tests' way."""
    yield from running_lab(tmp_path_factory.mktemp("fuzz-home"))


@pytest.fixture(scope="module")
def known_ids(fuzz_lab) -> dict[str, str]:
    api = Api(fuzz_lab.base_url, fuzz_lab.api_key)
    session = api.session()
    model = api.model(session, 0, {"rank": 2})
    saved = api.post("/save_weights", json={"model_id": model, "path": "fz", "seq_id": 1, "type": "save_weights"})
    path = api.result(saved.json()["request_id"]).json()["path"]
    lease = api.http.put("/lab/leases/fz", json={"base_model": "x", "model_id": model})
    assert lease.status_code == 200, lease.text
    return {"session_id": session, "model_id": model, "run_id": model, "tinker_path": path, "name": "fz"}


CHECKPOINT_ACTION = {
    "PUT": "weights/fz/ttl",
    "POST": "weights/fz/publish",
    "DELETE": "weights/fz/publish",
    "GET": "weights/fz/external_weights_urls",
}


def with_known_ids(ids: dict[str, str]):
    def patch(drawn):
        case, use_known = drawn
        if use_known:
            for params in (case.path_parameters, case.body):
                if isinstance(params, dict):
                    params.update({key: ids[key] for key in params.keys() & ids.keys()})
            if "checkpoint_id" in (case.path_parameters or {}):
                case.path_parameters["checkpoint_id"] = CHECKPOINT_ACTION[case.method.upper()]
        return case

    return patch


def problem(case, response, home: str) -> str | None:
    where = f"{case.method} {case.formatted_path}"
    if response.status_code >= 500:
        return f"{where}: {response.status_code} {response.text[:300]}"
    text = response.text
    if case.formatted_path.endswith("/get_info") and response.status_code == 200:
        # The one path a client on the server's own machine is told: the model directory its tokenizer
        # loads from (tests/gateway/test_wire_and_bad_input.py checks that a remote client is not).
        tokenizer_dir = response.json()["model_data"]["tokenizer_id"]
        assert tokenizer_dir.startswith(f"{home}/models/"), tokenizer_dir
        text = text.replace(tokenizer_dir, "")
    if home in text:
        return f"{where} shows the server's home: {text[:300]}"
    if case.method.upper() == "HEAD":  # no body, by HTTP's rules (the /hf mirror's files): the header says why
        if response.status_code >= 400 and not response.headers.get("x-error-message"):  # keys lower-cased
            return f"{where}: a {response.status_code} without X-Error-Message"
    elif response.status_code >= 400 and not response.text.strip():
        return f"{where}: an empty {response.status_code}"
    return None


# schemathesis's own pytest plugin needs pytest internals that pytest 9 no longer has: hypothesis drives it here
def test_no_answer_is_a_server_error_or_shows_a_server_path(fuzz_lab, known_ids):
    schema = schemathesis.openapi.from_url(f"{fuzz_lab.base_url}/openapi.json")
    schema.config.generation.update(with_security_parameters=False)  # the key is ours; fuzz the rest
    operations = [result.ok() for result in schema.get_all_operations()]
    with_bodies = [op for op in operations if op.body]
    assert len(operations) >= 38 and len(with_bodies) >= 24  # every route, and its body, is in the schema
    problems = []
    for operation in operations:
        cases = st.one_of(
            *(
                st.tuples(operation.as_strategy(mode), st.booleans()).map(with_known_ids(known_ids))
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            )
        )

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(cases)
        def answers_well(case):
            response = case.call(headers={"X-API-Key": fuzz_lab.api_key}, timeout=60)
            found = problem(case, response, str(fuzz_lab.home))
            assert found is None, found

        try:
            answers_well()
        except AssertionError as e:
            problems.append(str(e).splitlines()[0])
    assert not problems, "\n".join(problems)
