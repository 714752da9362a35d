"""The Ray shell around the driver's loop: start Ray and place the roles (`cluster`, `placement`),
the actors that host each role's worker (`actors`), how each role is built from the config
(`roles`), the memory check (`memory`), and a whole run (`run.run_training`). `standalone` is
`tandem eval` and `tandem generate`, the roles in one process without Ray.

This package imports nothing by itself (Ray loads with `tandem.runtime.cluster`): import each name
from its module.
"""
