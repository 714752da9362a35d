"""Imported first in a reward pool's fork server (`multiprocessing` preload): the fork server dies
with the process that started it, as the pool's workers die with the fork server."""

from tandem.sandbox import die_with_parent

die_with_parent()
