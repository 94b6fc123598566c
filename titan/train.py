# `python -m titan.train`, the trainer's name until it moved into titan/trainer/
from titan.runtime.moved import run_moved

if __name__ == "__main__":
    run_moved("titan.train", "titan.trainer.train", called="titan.trainer")
