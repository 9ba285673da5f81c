"""The README's configuration reference names every field the code accepts, and nothing else."""

import re
from pathlib import Path

from tasks.core.config import RunConfig

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
    documented = set(re.findall(r"^\| `([a-z_.]+)` \| `", README.read_text(), flags=re.M))
    assert documented == config_fields()
