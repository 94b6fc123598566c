"""The example plugin's entries (tests/plugins/titan_plugin_example) in the test process."""

import contextlib
from pathlib import Path

from titan.config import extensions

FOLDER = Path(__file__).resolve().parent / "plugins" / "titan_plugin_example"


@contextlib.contextmanager
def registered(file: str, name: str, register, unregister):
    """The entry `name` of the plugin's `file`, registered in this process while the block
    runs (forked ranks inherit it); yields the module. Importing registers it the first time;
    a later test registers the module's SPEC again."""
    module = extensions.import_plugin(str(FOLDER / file))
    if name not in extensions.sections():
        register(module.SPEC)
    try:
        yield module
    finally:
        unregister(name)
