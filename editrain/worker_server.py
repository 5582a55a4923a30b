"""The fork server's preload module: every child the server forks dies with it.

Imported by the server that editrain's workers are forked from, and nowhere else
(``multiprocessing``'s preload list, :func:`editrain.spawn.start_worker_server`); see
:func:`editrain.spawn.children_die_with_this_process`.
"""

from editrain.spawn import children_die_with_this_process

children_die_with_this_process()
