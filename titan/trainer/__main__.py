# run as titan.trainer.train itself, not imported from here: the processes DCP's async saves
# spawn re-import the main module by its name (a package's __main__ is skipped), and that
# import is what quiets them (titan.trainer.train's __mp_main__ branch)
import runpy

runpy.run_module("titan.trainer.train", run_name="__main__", alter_sys=True)
