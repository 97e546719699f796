"""Pipeline parallelism: schedules as data, their simulator, and the executor that runs them.

Imports go one way, down this list (each module imports only modules above it):

    schedules                    Action, the stage placements, the fixed-order generators (GPipe, 1F1B, ...)
    simulate, check, partition   timing and deadlock of lists without processes; list checks; layers to stages
    zb_v, registry               schedule "zb-v" (a list scheduler on the simulator); every schedule by name
    comm_actions                 the sends and receives of compute lists
    p2p, stage, weight_grad      transfers between ranks; a stage's module; deferred weight gradients
    backward, graphs, executor   split backward, CUDA graphs of actions, running one rank's list
    parallel                     ``PipelineParallel``, the model wrapper the engine drives
"""
