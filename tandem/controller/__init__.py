"""The controller: builds the roles and drives the loop (sync mode today)."""

from tandem.controller.roles import Roles, build_roles
from tandem.controller.sync import run_sync

__all__ = ["Roles", "build_roles", "run_sync"]
