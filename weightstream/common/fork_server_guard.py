"""Imported by weightstream's fork server only, first of its preload list (``launch.process_context`` puts
it there when the main thread asks for the fork server): the fork server then dies with the process that
started it, and the ranks and engine workers forked from it, which ask the same for themselves, die with it.

Without this, a SIGKILLed ``weightstream dump`` left its fork server and a rank alive until the rank's
collective timed out (the fork server stays up while any process it forked lives). Should the starting
process die before this runs, the fork server ends by itself: multiprocessing closes it once no process
holds its "alive" pipe, and every launched rank checks on its own that its launcher is still running.
"""

from weightstream.common.processes import die_with_parent

die_with_parent()
