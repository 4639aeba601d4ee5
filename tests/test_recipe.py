from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from draftsmith.adapt.config import AdaptRecipe
from draftsmith.config import RecipeError, load_recipe, parse_overrides
from draftsmith.kinds import for_recipe
from draftsmith.recipe import OVERRIDE_ALIASES, Recipe

RECIPE = """
target:
  name: default
  dtype: bfloat16
data:
  max_length: 512
training:
  learning_rate: 3e-5
  max_steps: 100
  adam_betas: [0.9, 0.95]
distributed:
  backend: deepspeed
  zero_stage: 2
"""


def test_recipe_parses_into_typed_sections(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    recipe = load_recipe(Recipe, path)
    assert recipe.target.dtype == "bfloat16"
    assert recipe.training.learning_rate == pytest.approx(3e-5)  # YAML 1.1 reads 3e-5 as a string
    assert recipe.training.max_steps == 100
    assert recipe.distributed.zero_stage == 2
    assert recipe.data.path == "sharegpt"  # default kept


def test_misspelled_key_names_file_and_key_path(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(RECIPE.replace("learning_rate", "lerning_rate"))
    with pytest.raises(
        RecipeError, match=r"typo.yaml: unknown key training.lerning_rate \(did you mean 'training.learning_rate'\?\)"
    ):
        load_recipe(Recipe, path)


def test_wrong_type_names_key_path(tmp_path):
    path = tmp_path / "type.yaml"
    path.write_text(RECIPE.replace("max_steps: 100", "max_steps: lots"))
    with pytest.raises(RecipeError, match=r"type.yaml: training.max_steps: expected int \| null, got 'lots'"):
        load_recipe(Recipe, path)
    path.write_text(RECIPE.replace("zero_stage: 2", "zero_stage: 5"))
    with pytest.raises(RecipeError, match=r"distributed.zero_stage: expected one of 0 \| 1 \| 2 \| 3, got 5"):
        load_recipe(Recipe, path)
    path.write_text(RECIPE.replace("max_length: 512", "max_length: 2"))
    with pytest.raises(RecipeError, match=r"type\.yaml: data\.max_length must be an integer >= 8, got 2$"):
        load_recipe(Recipe, path)


def test_overrides_change_fields_and_are_validated(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    recipe = load_recipe(
        Recipe,
        path,
        ["--training.learning_rate", "1e-4", "data.limit=10", "--output_dir=runs/x"],
        aliases=OVERRIDE_ALIASES,
    )
    assert recipe.training.learning_rate == pytest.approx(1e-4)
    assert recipe.data.limit == 10
    assert recipe.training.output_dir == "runs/x"
    assert recipe.training.max_steps == 100  # untouched fields keep the file's value
    with pytest.raises(RecipeError, match="unknown key training.nope"):
        load_recipe(Recipe, path, ["--training.nope", "1"])
    assert parse_overrides(["--a.b-c", "[1, 2]"]) == {"a": {"b_c": [1, 2]}}


def test_drafter_section_is_typed_per_kind():
    @dataclass
    class HeadConfig:
        kind: str = "toy"
        num_layers: int = 1

    @dataclass
    class ToyRecipe(Recipe):
        drafter: HeadConfig = field(default_factory=HeadConfig)

    recipe = load_recipe(ToyRecipe, None, {"drafter": {"num_layers": 2}})
    assert recipe.drafter.num_layers == 2
    with pytest.raises(RecipeError, match="drafter.num_layers: expected int"):
        load_recipe(ToyRecipe, None, {"drafter": {"num_layers": "two"}})


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_recipe_loads_into_its_training_script(path):
    """A recipe we ship must parse and validate (no unknown keys) with the script its kind names
    (the kind registry maps a recipe's drafter.kind to its recipe class), or draftsmith-adapt's."""
    data = yaml.safe_load(path.read_text())
    if "adapt" in data:
        assert load_recipe(AdaptRecipe, path).adapt.head.endswith("checkpoint-final")
        return
    kind = data["drafter"]["kind"]
    recipe = load_recipe(for_recipe(kind).training.recipe, path)
    assert recipe.drafter.kind == kind
    # They learn the target's own replies, but for the demo-sized ones (regeneration does not fit their minutes)
    # and the GPU run's (its conversations travel as they are; regenerating them there is not yet measured).
    own_replies = ("demo", "general", "gpu")
    if kind in ("eagle3", "peagle") and not any(word in path.name for word in own_replies):
        assert recipe.data.regenerate.enabled and recipe.drafter.ttt_steps == (
            7 if "smollm2" in path.name or kind == "eagle3" else 8
        )
    if kind == "eagle":  # EAGLE-1's input-feature noise is the paper's U(-0.1, 0.1)
        assert recipe.drafter.feature_noise == 0.1


# Training recipes (an adapt recipe trains with its head's recipe settings).
CPU_RECIPES = [
    p
    for p in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("smollm2-*.yaml"))
    if "adapt" not in yaml.safe_load(p.read_text())
]


@pytest.mark.parametrize("path", CPU_RECIPES, ids=lambda p: p.name)
def test_cpu_recipes_leave_the_dtype_to_the_measurement(path):
    """bf16 runs ~40-140x slower than fp32 on CPUs without native bf16: a CPU recipe must not pin it
    (or any dtype); ``auto`` measures (draftsmith.precision)."""
    recipe = load_recipe(Recipe, None, {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "drafter"})
    assert (recipe.target.dtype, recipe.training.mixed_precision) == ("auto", "auto")
