import cProfile, os, sys, runpy
from mpi4py import MPI
r = MPI.COMM_WORLD.rank
sys.argv = ["mpips"] + sys.argv[1:]
cProfile.run("runpy.run_module('mpips', run_name='__main__')", f"/tmp/prof/rank{r}.prof")
