"""The README's configuration reference is RunConfig's, word for word: every field the code
accepts, with its default, values and help text, and nothing else."""

import re
from pathlib import Path

from islands.core.config import REFERENCE_BEGIN, REFERENCE_END, RunConfig, load_config, reference_table, with_reference

README = Path(__file__).resolve().parents[1] / "README.md"


def config_fields() -> set[str]:
    out = set()
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and hasattr(section, "model_fields"):
            out |= {f"{name}.{sub}" for sub in section.model_fields}
        else:
            out.add(name)
    return out


def test_config_reference_matches_the_code():
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \| `", README.read_text(), flags=re.M))
    assert documented == config_fields()


def test_config_reference_is_the_generated_one():
    text = README.read_text()
    section = text[text.index(REFERENCE_BEGIN) + len(REFERENCE_BEGIN) : text.index(REFERENCE_END)]
    assert section.strip("\n") == reference_table(), (
        "README.md's configuration reference is not RunConfig's; regenerate it with "
        "`.venv/bin/python -m islands.core.config --write README.md`"
    )


def test_regenerating_changes_nothing_else():
    text = README.read_text()
    assert with_reference(text) == text


def test_a_changed_help_text_shows_in_the_reference():
    """The reference is read from the fields themselves, not from a copy kept beside them."""
    field = RunConfig.model_fields["rounds"]
    before = field.description
    try:
        field.description = "Outer rounds, said another way."
        assert "| `rounds` | `12` | integer, ≥ 1 | Outer rounds, said another way. |" in reference_table()
    finally:
        field.description = before
    assert f"| {before} |" in reference_table()


def test_the_readmes_example_config_is_valid(tmp_path):
    """Every run.toml the README shows loads as it is."""
    examples = re.findall(r"^```toml\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    assert examples, "the README shows an example run.toml"
    for i, example in enumerate(examples):
        path = tmp_path / f"example-{i}.toml"
        path.write_text(example)
        load_config(path, {})  # raises ConfigError naming the field that is wrong
