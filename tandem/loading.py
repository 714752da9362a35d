"""`pkg.module:attr` names to the objects they name: the one loader behind every such name a config
or a table gives (a role's worker, an engine's builder, an agent, a reward function), over the
standard library's `pkgutil.resolve_name` (it imports the module, then walks a dotted attribute).
Each caller words the error its users see, naming its config key, from `LoadError`'s fields."""

import pkgutil
import sys
from typing import Any

from tandem.errors import TandemError


class LoadError(TandemError):
    """`name` does not load. `reason`: "shape" (not "pkg.module:attr" with Python names), "import"
    (the module does not import: `error` is the ImportError) or "attribute" (the module, imported,
    has no such attribute); `module` and `attr` are the name's two parts."""

    def __init__(self, name: str, reason: str, error: Exception | None = None):
        self.name, self.reason, self.error = name, reason, error
        self.module, _, self.attr = name.partition(":")
        super().__init__(
            {
                "shape": f"{name!r} is not of the form 'pkg.module:attr'.",
                "import": f"Cannot import module {self.module!r} of {name!r}: {error}.",
                "attribute": f"Module {self.module!r} has no attribute {self.attr!r} ({name!r}).",
            }[reason]
        )


def load(name: str) -> Any:
    """ "pkg.module:attr" (attr may be dotted) -> the object; LoadError naming what failed. An
    exception the module's own code raises as it runs (other than an ImportError) is not a bad
    name: it goes to the caller as it is."""
    module, sep, attr = name.partition(":")
    if not sep or not _dotted(module) or not _dotted(attr):
        raise LoadError(name, "shape")
    try:
        return pkgutil.resolve_name(name)
    except ImportError as e:
        raise LoadError(name, "import", e) from None
    except AttributeError as e:
        if module not in sys.modules:  # raised by the module's code: a failed import is not kept
            raise
        raise LoadError(name, "attribute", e) from None


def _dotted(part: str) -> bool:
    """A dotted Python name ("pkg.module", "Class.method"): what resolve_name takes on either side."""
    return all(word.isidentifier() for word in part.split("."))
