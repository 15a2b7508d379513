"""TRACE stage 2 by synthesis, through a real OpenAI-compatible server on the loopback address: the writer
asks again with each failure report until a module passes (prose without code, a module that raises on some
seeds, then a correct one), the accepted environment's exported tasks are the module's own and score 1.0 for
the gold agent and 0.0 for doing nothing through the rollout engine, a rerun resumes without a request, a
module that never passes is given up after max_attempts, and the sandbox stops modules that loop, sleep or
allocate without limit, reporting each while the caller lives on."""

import json
import pathlib
import random
import time
import types

import jax
import ml_collections
import pytest
from scripted_llm_server import ScriptedLLMServer

from trace_jax.agent.rollout import EpisodeSpec, RolloutConfig, RolloutEngine
from trace_jax.envs import make_environment
from trace_jax.envs.capability import CapabilityEnvironment, authoring, example_airline, example_retail
from trace_jax.envs.capability.authoring import AuthoringError, capability_from_module, check_scenario
from trace_jax.envs.capability.sandbox import Checks, Limits, ValidationReport, validate_module
from trace_jax.envs.scripted import GoldAgent, NoopAgent, ScriptedUser
from trace_jax.envs.tau2_bridge import domain_state
from trace_jax.llm import ChatClient, LlmSettings
from trace_jax.settings import defaults, from_config
from trace_jax.trace.analyst import CapabilityCard
from trace_jax.trace.calibration import environment_config
from trace_jax.trace.env_writer import NO_CODE, EnvWriterSettings, extract_code, write_environment

EXAMPLE = pathlib.Path(example_retail.__file__).read_text()
CARD = CapabilityCard(
    "order_facts",
    "Reads the order asked about and states the facts asked for.",
    "Answers without reading the order, or leaves out the fact.",
)
EVIDENCE = ["traj 3: replied 'your order is on its way' without calling get_order_details"]
SEEDS = 20
TASKS = SEEDS  # exported per split and difficulty (at least the seeds the replay plays)


def _edited(source: str, old: str, new: str) -> str:
    """`source` with `old` replaced, which must be there (an edit that misses leaves a module that passes)."""
    assert source.count(old) == 1, f"{old!r} is not in the example once"
    return source.replace(old, new)


# a module that raises IndexError for customers without a processed order
RAISES = _edited(EXAMPLE, "order = rng.choice(orders)", 'order = [o for o in orders if o.status == "processed"][0]')
# a task set whose first tool set lacks the tool its gold calls use
NOT_OFFERED = _edited(EXAMPLE, '("find_user_id_by_email", "get_order_details"),\n', '("find_user_id_by_email",),\n')
NO_TOOLS = _edited(EXAMPLE, "TOOLS = (", "_TOOLS = (")
LOOPS = "NAME = 'order_facts'\nwhile True:\n    pass\n"


def _fenced(source):
    return f"Here is the module.\n\n```python\n{source}```\n"


def _config(**changes):
    return EnvWriterSettings(**{"seeds": SEEDS, "export_tasks": TASKS, **changes})


def _client(server, cache):
    return ChatClient(LlmSettings(model="scripted", base_url=server.base_url, max_retries=0), cache)


def _play(env, agent, tasks):
    engine = RolloutEngine(env, agent=agent, user=ScriptedUser(), config=RolloutConfig(batch_size=8, max_turns=8))
    return engine.run([EpisodeSpec(task, 0, -1) for task in tasks], key=jax.random.key(0))


def test_the_writer_asks_again_with_each_failure_until_a_module_passes_then_resumes(tmp_path):
    script = ["I would build an environment where the customer asks about an order.", _fenced(RAISES), _fenced(EXAMPLE)]
    folder, cache = tmp_path / "order_facts", tmp_path / "llm_cache"
    with ScriptedLLMServer(script) as server:
        synthesis = write_environment(CARD, EVIDENCE, _client(server, cache), folder, _config())
        sent = server.requests
    assert (synthesis.accepted, synthesis.attempts, synthesis.requests, len(sent)) == (True, 3, 3, 3)
    assert [len(r["messages"]) for r in sent] == [2, 4, 6]  # one conversation, each failure answered in it
    system, first = sent[0]["messages"][0]["content"], sent[0]["messages"][1]["content"]
    assert authoring.guide("retail") in system and "online retail store" in system and EXAMPLE.strip() in first
    assert "NAME = 'order_facts'\nDOMAIN = 'retail'" in first and "get_reservation_details" not in first
    assert "return_delivered_order_items [write]: Return some items" in first and EVIDENCE[0] in first
    assert "    reason (string): The reason for cancellation, which should be either 'no longer needed'" in first
    assert NO_CODE in sent[1]["messages"][-1]["content"]
    raised = sent[2]["messages"][-1]["content"]
    assert "IndexError: list index out of range" in raised and "seed " in raised and 'File "module.py"' in raised
    assert [r.passed for r in synthesis.reports] == [False, False, True]
    assert synthesis.reports[1].exceptions > 0 and synthesis.reports[2].exported == 2 * 2 * TASKS
    assert (folder / "module.py").read_text() == EXAMPLE and not (folder / "attempt_1.py").exists()
    assert json.loads((folder / "validation.json").read_text())["gold_success"] == [1.0, 1.0]
    assert (folder / "attempt_2.py").read_text() == RAISES and (folder / "attempt_3.json").exists()

    live = capability_from_module(example_retail)
    for difficulty in (0, 1):
        env = synthesis.environment(difficulty, policy=False)
        tasks = env.tasks("train") + env.tasks("heldout")
        settings = ml_collections.ConfigDict(dict(policy=False, cut_share=0.0))
        built = make_environment(
            ml_collections.ConfigDict(
                environment_config(  # as calibration and training build it
                    "order_facts", difficulty, settings, synthesis.scenarios
                )
            )
        )
        assert [t.task_id for t in built.tasks("train")] == [t.task_id for t in env.tasks("train")]
        assert len(tasks) == 2 * TASKS
        assert {t.outcome.reward for t in _play(env, GoldAgent(), tasks)} == {1.0}, difficulty
        assert {t.outcome.reward for t in _play(env, NoopAgent(), tasks)} == {0.0}, difficulty
        same = CapabilityEnvironment(live, seed=0, difficulty=difficulty, policy=False)  # the module's own tasks
        assert [t.task_id for t in same.tasks("heldout", TASKS)] == [t.task_id for t in env.tasks("heldout")]
        for mine, theirs in zip(env.tasks("heldout"), same.tasks("heldout", TASKS)):
            assert (env.scenario(mine).ticket, env.scenario(mine).gold_calls, env.scenario(mine).db) == (
                same.scenario(theirs).ticket,
                same.scenario(theirs).gold_calls,
                same.scenario(theirs).db,
            )
    with pytest.raises(ValueError, match=f"holds {TASKS} train tasks of difficulty 0; task {TASKS} was asked"):
        synthesis.environment().tasks("train", TASKS + 1)
    mix = synthesis.environment(0.5, policy=False)  # calibration's mix of two levels: exported tasks of each
    assert {mix.level(t.task_id.split("/", 1)[1]) for t in mix.tasks("train")} == {0, 1}
    assert {t.outcome.reward for t in _play(mix, GoldAgent(), mix.tasks("train"))} == {1.0}

    with ScriptedLLMServer([]) as server:  # a rerun: nothing is asked or validated again
        again = write_environment(CARD, EVIDENCE, _client(server, cache), folder, _config())
        assert again == synthesis and not server.requests


def test_an_airline_environment_is_written_against_the_airline_api_and_played_with_tau2_airline_tools(tmp_path):
    """The writer is shown the airline guide, tools and example; a module of the wrong domain is sent back; the
    accepted one's tasks are synthetic customers and reservations on τ²'s flight schedule, played through τ²'s
    airline tools under its policy."""
    airline = pathlib.Path(example_airline.__file__).read_text()
    wrong_domain = _edited(airline, 'DOMAIN = "airline"', 'DOMAIN = "retail"')
    card = CapabilityCard(
        "reservation_facts",
        "Reads the reservation asked about and states the facts asked for.",
        "Answers without reading the reservation.",
    )
    with ScriptedLLMServer([_fenced(wrong_domain), _fenced(airline)]) as server:
        synthesis = write_environment(card, [], _client(server, None), tmp_path, _config(), domain="airline")
        sent = server.requests
    system, first = sent[0]["messages"][0]["content"], sent[0]["messages"][1]["content"]
    assert authoring.guide("airline") in system and "agents of an airline" in system and "RETAIL DOMAIN" not in system
    assert "DOMAIN = 'airline'" in first and airline.strip() in first
    assert "get_flight_status [read]: Get the status of a flight." in first and "find_user_id_by_email" not in first
    assert "DOMAIN = 'retail', but this environment is for τ²'s airline domain" in sent[1]["messages"][-1]["content"]
    assert (synthesis.accepted, synthesis.attempts, synthesis.reports[-1].gold_success) == (True, 2, (1.0, 1.0))
    target = domain_state("airline").db
    for difficulty in (0, 1):
        env = synthesis.environment(difficulty)
        assert {t["function"]["name"] for t in env.tools} == set(example_airline.TOOLS[difficulty])
        assert env.system_prompt.startswith("You are a customer service agent of an airline")
        assert "# Airline Agent Policy" in env.system_prompt
        tasks = env.tasks("heldout")
        for task in tasks:
            db = env.scenario(task).db
            assert not set(db.users) & set(target.users) and not set(db.reservations) & set(target.reservations)
            assert all(
                any(f.date > "2024-05-15" for f in db.reservations[r].flights)
                for u in db.users.values()
                for r in u.reservations[:1]
            )  # each customer's first flies later
        assert {t.outcome.reward for t in _play(env, GoldAgent(), tasks)} == {1.0}, difficulty
        assert {t.outcome.reward for t in _play(env, NoopAgent(), tasks)} == {0.0}, difficulty
    assert {env.scenario(t).variant for t in tasks} == {"flight_status", "cabin", "paid"}


def test_a_module_that_never_passes_is_given_up_after_max_attempts_and_the_rerun_asks_nothing(tmp_path):
    script = [_fenced(LOOPS), _fenced(NO_TOOLS), _fenced(NOT_OFFERED)]
    # two seeds: validating the module that breaks the API on every seed then takes ~0.3 CPU s, well inside the
    # 2 s that stops the loop quickly (20 seeds took more than 2 s on a loaded 2-core CI machine)
    config = _config(max_attempts=3, cpu_s=2.0, seeds=2)
    folder, cache = tmp_path / "order_facts", tmp_path / "llm_cache"
    with ScriptedLLMServer(script) as server:
        synthesis = write_environment(CARD, EVIDENCE, _client(server, cache), folder, config)
        assert len(server.requests) == 3
    assert not synthesis.accepted and synthesis.attempts == 3 and synthesis.environment() is None
    loops, no_tools, not_offered = (r.failure_report() for r in synthesis.reports)
    assert "CPU-time limit of 2 s" in loops
    assert (
        "breaks the authoring API: the module must define NAME, DOMAIN, DESCRIPTION, TOOLS, generate; it "
        "does not define TOOLS" in no_tools
    )
    assert "gold_calls use ['get_order_details'], which TOOLS[0] does not offer" in not_offered
    assert not (folder / "module.py").exists() and not (folder / "scenarios.json").exists()
    start = time.monotonic()
    with ScriptedLLMServer([]) as server:  # replies from the cache, reports from the attempts' files
        client = _client(server, cache)
        again = write_environment(CARD, EVIDENCE, client, folder, config)
        assert not server.requests and client.stats["cache_hits"] == 3
    assert again.reports == synthesis.reports and (again.requests, again.cache_hits) == (0, 3)
    assert time.monotonic() - start < 5  # no sandbox was started


@pytest.mark.parametrize(
    "source, limits, expected",
    [
        ("import time\ntime.sleep(3600)\n", Limits(timeout_s=8, cpu_s=60), "wall-clock limit of 8 s"),
        (
            "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 2**20))\n",
            Limits(timeout_s=120, memory_mb=256),
            "memory limit of 256 MB",
        ),
        ("def generate(rng difficulty):\n", Limits(), "SyntaxError"),
    ],
)
def test_the_sandbox_reports_a_module_that_sleeps_allocates_or_does_not_parse(source, limits, expected):
    start = time.monotonic()
    report = validate_module(source, checks=Checks(seeds=2), limits=limits)
    assert not report.passed and expected in report.failure_report(), report
    assert time.monotonic() - start < limits.timeout_s + 30


def _module(**changes):
    module = types.ModuleType("written")
    for name in ("NAME", "DOMAIN", "DESCRIPTION", "TOOLS", "generate"):
        setattr(module, name, changes.get(name, getattr(example_retail, name)))
    return module


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"TOOLS": (("find_user_id_by_email", "teleport"),)},
            r"TOOLS\[0\] names tools .* does not have: \['teleport'\]",
        ),
        ({"TOOLS": ()}, "TOOLS must be a tuple of 1 to 5 tuples"),
        ({"NAME": "Order Facts"}, "NAME must be a snake_case string"),
        ({"NAME": "other_thing"}, "NAME = 'other_thing', but this environment is for the capability 'order_facts'"),
        ({"generate": lambda rng: None}, r"generate must be a function generate\(rng, difficulty, catalogue\)"),
        ({"DOMAIN": "telecom"}, "DOMAIN must be one of 'retail', 'airline'; got 'telecom'"),
        ({"DOMAIN": ["retail"]}, "DOMAIN must be one of 'retail', 'airline'; got \\['retail'\\]"),
        ({"DOMAIN": "airline"}, "DOMAIN = 'airline', but this environment is for τ²'s retail domain"),
    ],
)
def test_the_authoring_api_names_what_a_module_gets_wrong(changes, message):
    assert capability_from_module(_module(), "order_facts", "retail").tools == example_retail.TOOLS
    with pytest.raises(AuthoringError, match=message):
        capability_from_module(_module(**changes), "order_facts", "retail")


def test_scenario_checks_and_code_extraction():
    scenario = example_retail.generate(random.Random(0), 0, domain_state("retail").db.products)
    check_scenario(scenario, 0, example_retail.TOOLS[0], "retail")
    with pytest.raises(AuthoringError, match="hold commas"):
        check_scenario(type(scenario)(**{**vars(scenario), "facts": ("1,200",)}), 0, example_retail.TOOLS[0], "retail")
    with pytest.raises(AuthoringError, match="generate returned dict, not a Scenario"):
        check_scenario({}, 0, example_retail.TOOLS[0], "retail")
    with pytest.raises(AuthoringError, match="Scenario.db must be a FlightDB"):  # a retail world for airline
        check_scenario(scenario, 0, example_airline.TOOLS[0], "airline")
    with pytest.raises(
        AuthoringError,
        match=r"TOOLS\[0\] names tools τ²'s airline domain does not have: "
        r"\['find_user_id_by_email', 'get_order_details'\]",
    ):
        capability_from_module(_module(DOMAIN="airline"), "order_facts")
    assert extract_code("no code here") is None
    assert extract_code("```python\nx = 1\n```\nand\n```python\nNAME = 'a'\ny = 2\n```") == "NAME = 'a'\ny = 2\n"


def test_a_report_names_each_failed_check_and_survives_json():
    report = ValidationReport(
        passed=False,
        checks=Checks(seeds=4),
        name="x",
        gold_success=(0.5, 1.0),
        empty_reward=(0.0, 0.25),
        exceptions=1,
        first_exceptions=("1 plays (seed 2): Boom",),
        gold_failures=("seed 1, difficulty 0: reward 0.8",),
    )
    text = report.failure_report()
    assert "played on 4 seeds at each of its difficulties (0, 1)" in text and "1 plays raised" in text
    assert "scored 1.0 on 50%, 100% of the seeds" in text and "seed 1, difficulty 0: reward 0.8" in text
    assert "does nothing scored 0.00, 0.25 on average" in text
    assert ValidationReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert ValidationReport.failed("stopped", Checks()).failure_report() == "stopped"


def test_bad_settings_fail_naming_the_key():
    assert (EnvWriterSettings().max_attempts, EnvWriterSettings().seeds, Checks().seeds) == (5, 100, 100)
    config = defaults(EnvWriterSettings)
    config.max_attempts = 0
    with pytest.raises(ValueError, match="config.env_writer.max_attempts = 0"):
        from_config(EnvWriterSettings, config, "env_writer")


def test_a_module_the_judge_rejects_is_asked_for_again_with_its_verdict(tmp_path):
    """The pipeline's judge is calibration: a module that passes validation but not the judge is a failed
    attempt, and the judge's verdict is the report sent back; the next module that passes both is accepted."""
    verdict = "The tasks are too hard for the agent: make them easier."
    judged = []

    def judge(attempt, report, scenarios):
        judged.append((attempt, report.passed, scenarios.is_file()))
        return verdict if attempt == 1 else None

    folder, cache = tmp_path / "order_facts", tmp_path / "llm_cache"
    with ScriptedLLMServer([_fenced(EXAMPLE), _fenced(EXAMPLE + "\n")]) as server:
        synthesis = write_environment(CARD, EVIDENCE, _client(server, cache), folder, _config(), judge=judge)
        sent = server.requests
    assert (synthesis.accepted, synthesis.attempts, judged) == (True, 2, [(1, True, True), (2, True, True)])
    assert verdict in sent[1]["messages"][-1]["content"]
    assert json.loads((folder / "attempt_1.json").read_text())["error"] == verdict
    assert (folder / "module.py").read_text() == EXAMPLE + "\n"
