# `python -m titan.generate`, the sampling tool's name until it moved into titan/tools/
from titan.runtime.moved import run_moved

if __name__ == "__main__":
    run_moved("titan.generate", "titan.tools.generate")
