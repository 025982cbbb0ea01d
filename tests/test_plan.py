"""Plans: validation messages, YAML round trip, printout, batch splits, default plans."""

import pytest

from lightning_distmm.core import Plan, PlanError, TowerPlan, colocated_plan, split_batch
from lightning_distmm.planner.default import proportional_plan


def test_yaml_round_trip(tmp_path):
    plan = Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 3]}, "text": {"ranks": [3]}}, 10)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    again = Plan.from_yaml(path)
    assert again == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert again.towers["image"].dp == 3


def test_table_is_readable():
    text = str(Plan(4, {"image": {"ranks": [0, 1, 2], "replica_batch": [4, 3, 3]}, "text": {"ranks": [3]}}, 10))
    assert "4+3+3" in text and "layout=separate" in text and "image" in text and "0-2" in text


@pytest.mark.parametrize(
    "data, message",
    [
        ({"world_size": 2, "towers": {"image": {"ranks": [0, 2]}}}, r"ranks \[2\] outside the world of 2"),
        ({"world_size": 3, "towers": {"image": {"ranks": [0, 1]}}}, r"ranks \[2\] run no tower"),
        (
            {"world_size": 2, "towers": {"image": {"ranks": [0, 1], "replica_batch": [3]}}},
            "replica_batch has 1 entries",
        ),
        ({"world_size": 1, "towers": {"image": {"ranks": [0], "schedule": "zigzag"}}}, "unknown schedule 'zigzag'"),
        (
            {"world_size": 1, "towers": {"image": {"ranks": [0], "colour": 1}}},
            r"tower 'image': unknown key\(s\) \['colour'\]",
        ),
        ({"world_size": 1, "towers": {"image": {"ranks": [0]}}, "extra": 1}, r"unknown plan key\(s\) \['extra'\]"),
        ({"world_size": 2, "towers": {"image": {"ranks": [0, 1], "tp": 3}}}, "do not divide into replicas"),
        ({"world_size": 3, "global_batch": 2, "towers": {"image": {"ranks": [0, 1, 2]}}}, "smaller than its 3"),
        (
            {"world_size": 2, "global_batch": 9, "towers": {"image": {"ranks": [0, 1], "replica_batch": [4, 4]}}},
            "sums to 8, not the global batch 9",
        ),
    ],
)
def test_validation_names_the_problem(data, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_yaml_with_unknown_keys_fails(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("world_size: 1\ntowers:\n  image: {ranks: [0]}\nbalancer: dp\n")
    with pytest.raises(PlanError, match="balancer"):
        Plan.from_yaml(path)


def test_world_and_tower_checks():
    plan = colocated_plan(["image", "text"], 2)
    with pytest.raises(PlanError, match="world_size=2 but the trainer runs 4"):
        plan.check_world(4)
    with pytest.raises(PlanError, match=r"tower\(s\) \['text'\] that the module does not define"):
        plan.check_towers(["image", "audio"])
    with pytest.raises(PlanError, match="global batch 1 is smaller than its 2"):
        plan.check_global_batch(1)


def test_split_batch():
    assert split_batch(10, None, 3) == [4, 3, 3]
    assert split_batch(10, [4, 3, 3], 3) == [4, 3, 3]
    assert split_batch(7, [4, 3, 3], 3) == [3, 2, 2]
    assert sum(split_batch(13, [5, 1, 1], 3)) == 13
    tower = TowerPlan(ranks=[0, 1, 2, 3], tp=2)
    assert tower.dp == 2 and tower.replica_of(3) == 1 and tower.feature_rank(1) == 2


def test_proportional_plan():
    plan = proportional_plan({"image": 10.0, "text": 1.0}, 4)
    assert plan.towers["image"].ranks == [0, 1, 2] and plan.towers["text"].ranks == [3]
    assert proportional_plan({"image": 10.0, "text": 1.0}, 1).colocated
    three = proportional_plan({"a": 1.0, "b": 1.0, "c": 100.0}, 5)
    assert [len(t.ranks) for t in three.towers.values()] == [1, 1, 3]


def test_distmm_plan_needs_rows_for_every_replica_in_each_sync_group():
    distmm = {"schedule": "distmm"}
    plan = Plan(3, {"image": {"ranks": [0, 1], **distmm}, "text": {"ranks": [2], **distmm}})
    assert plan.sync_groups == 2 and plan.group_split(7) == [4, 3] and plan.group_offsets(7) == [0, 4, 7]
    plan.check_global_batch(4)
    with pytest.raises(
        PlanError, match=r"each of the 2 sync groups of a global batch of 3 \(\[2, 1\]\) must give each of its 2"
    ):
        plan.check_global_batch(3)
    assert Plan(1, {"image": {"ranks": [0]}}).sync_groups == 1
    assert "loss over 2 sync groups" in plan.table() and "sync groups" not in Plan(1, {"image": {"ranks": [0]}}).table()


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "world_size: 1\ntowers:\n  image: {ranks: 0}\n",
            "plan.yaml: towers.image.ranks: expected a list of ints, got 0",
        ),
        (
            "world_size: 1\nglobal_batch: eight\ntowers:\n  image: {ranks: [0]}\n",
            "plan.yaml: global_batch: expected a positive int or null, got 'eight'",
        ),
        (
            "world_size: true\ntowers:\n  image: {ranks: [0]}\n",
            "plan.yaml: world_size: expected a positive int, got True",
        ),
        (
            "world_size: 1\nglobal_batch: 8.5\ntowers:\n  image: {ranks: [0]}\n",
            "plan.yaml: global_batch: expected a positive int or null, got 8.5",
        ),
        (
            "world_size: 2\ntowers:\n  image: {ranks: [true, 1]}\n",
            r"plan.yaml: towers.image.ranks: expected a list of ints, got \[True, 1\]",
        ),
        (
            "world_size: 2\ntowers:\n  image: {ranks: [0, 1], tp: yes}\n",
            "towers.image.tp: expected a positive int, got True",
        ),
        (
            "world_size: 1\ntowers:\n  image: {ranks: [0], replica_batch: 4}\n",
            "towers.image.replica_batch: expected a list of ints or null, got 4",
        ),
        (
            "world_size: 1\ntowers:\n  image: {ranks: [0], recompute: -1}\n",
            "towers.image.recompute: expected true, false or a number of blocks per stage",
        ),
        ("world_size: 1\ntowers: [image]\n", "plan.yaml: towers: expected a mapping"),
        ("world_size: 1\ntowers:\n  image: [0]\n", "plan.yaml: towers.image: expected a mapping of tower settings"),
    ],
)
def test_yaml_values_of_the_wrong_type_name_file_and_key(text, message, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        Plan.from_yaml(path)


def test_yaml_duplicate_key_is_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: the first tower's settings would vanish without a word."""
    path = tmp_path / "plan.yaml"
    path.write_text("world_size: 2\ntowers:\n  image: {ranks: [0]}\n  image: {ranks: [1]}\n")
    with pytest.raises(PlanError, match=r"plan.yaml: line 4: key 'image' is given twice \(first on line 3\)"):
        Plan.from_yaml(path)
    with pytest.raises(PlanError, match="key 'tp' is given twice"):
        Plan.from_yaml("world_size: 2\ntowers:\n  image: {ranks: [0, 1], tp: 2, tp: 1}\n")
    # a YAML merge key may still be overridden: that is not a duplicate
    merged = Plan.from_yaml("world_size: 2\ntowers:\n  image: &a {ranks: [0, 1]}\n  text: {<<: *a, tp: 2}\n")
    assert merged.towers["text"].tp == 2 and merged.towers["text"].ranks == [0, 1]


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("world_size: 2\ntowers:\n  image: {ranks: [0]\n")
    with pytest.raises(PlanError, match=r"plan.yaml: not valid YAML") as info:
        Plan.from_yaml(path)
    assert str(path) in str(info.value)


def test_bools_are_not_ints_in_code_either():
    with pytest.raises(PlanError, match="world_size must be a positive integer, got True"):
        Plan(True, {"image": {"ranks": [0]}})
    with pytest.raises(PlanError, match="global_batch must be a positive integer or None, got 8.5"):
        Plan(1, {"image": {"ranks": [0]}}, 8.5)
    with pytest.raises(PlanError, match=r"towers.image.ranks: expected a list of ints, got 'abc'"):
        Plan.from_dict({"world_size": 1, "towers": {"image": {"ranks": "abc"}}})


def test_a_batch_other_than_the_plans_is_stated_with_its_split():
    """A plan written for 10 (6 + 4) trained on batches of 8 ran as 5 + 3 without a word."""
    plan = Plan(3, {"image": {"ranks": [0, 1], "replica_batch": [6, 4]}, "text": {"ranks": [2]}}, global_batch=10)
    note = plan.batch_note(8)
    assert note is not None and "global batch of 10 (image: [6, 4])" in note and "image: [5, 3]" in note
    assert plan.batch_note(10) is None
    assert Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}}, global_batch=10).batch_note(8) is None
