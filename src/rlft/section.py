"""The base of every config section (kept apart from config.py so section models elsewhere, e.g.
the monitor's, can be imported by config.py without a cycle)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
