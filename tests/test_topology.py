"""Roles from the topology: which process trains and which samples, derived from the meshes (no processes)."""

import pytest

from configs import math_8b
from jaxrl_async.run_config import MeshConfig
from jaxrl_async.runtime.cluster import ClusterError, Flags, Roles, check_placement, connect


def _mesh(sampler, trainer, **kw):
    return MeshConfig(sampler, trainer, 1, **kw)


def test_roles_follow_from_the_meshes_and_devices_per_process():
    # 4 devices per process: a (4, 4) trainer takes processes 0-3, (1, 4) replicas one process each.
    roles = Roles.from_config(_mesh((1, 4), (4, 4)), 7, devices_per_process=4)
    assert roles.trainers == (0, 1, 2, 3) and roles.samplers == (4, 5, 6)
    assert roles.replicas == ((4,), (5,), (6,)) and roles.lead == 0
    assert [roles.role(p) for p in (0, 1, 4, 6)] == ["learner lead", "trainer", "sampler 0", "sampler 2"]
    # Meshes smaller than a process take one (their first devices).
    small = Roles.from_config(_mesh((2, 1), (1, 1)), 3, devices_per_process=4)
    assert small.trainers == (0,) and small.samplers == (1, 2)
    # A replica larger than a process takes whole processes; its first is the leader.
    wide = Roles.from_config(_mesh((2, 4), (4, 1)), 5, devices_per_process=4)
    assert wide.replicas == ((1, 2), (3, 4)) and wide.samplers == (1, 3)
    assert wide.role(2) == "sampler 0 member 1"


def test_explicit_role_lists_keep_working():
    mesh = _mesh((1, 1), (1, 1), sampler_processes=(2,), trainer_processes=(0, 1))
    roles = Roles.from_config(mesh, 3, devices_per_process=1)
    assert roles == Roles(3, (2,), (0, 1)) and roles.replicas == ((2,),)
    with pytest.raises(ClusterError, match=r"sampler_replicas=2 but config\.mesh\.sampler_processes=\(2,\)"):
        Roles.from_config(_mesh((1, 1), (1, 1), sampler_processes=(2,), trainer_processes=(0, 1),
                                sampler_replicas=2), 3)  # fmt: skip


def test_a_layout_that_cannot_be_placed_names_the_field_and_the_numbers():
    cases = [
        (_mesh((1, 1), (1, 1)), 2, None, r"set config\.mesh\.devices_per_process"),  # nothing to derive from
        (_mesh((4, 1), (6, 1)), 4, 4,
         r"config\.mesh\.trainer=\(6, 1\): a 6-device trainer does not fill whole processes of 4 devices"),
        (_mesh((1, 4), (8, 2)), 4, 4,
         r"config\.mesh\.trainer=\(8, 2\) takes 4 of the 4 processes of 4 devices, leaving 0; a sampler "
         r"replica .* needs 1"),
        (_mesh((2, 4), (4, 1)), 4, 4,
         r"the 3 processes left after the trainer's 1 do not divide into replicas of 2 processes"),
        (_mesh((1, 4), (8, 2), sampler_replicas=12), 8, 4,
         r"config\.mesh\.sampler_replicas=12: 12 replicas of 1 process\(es\) .* = 16 processes of 4 "
         r"devices; the run has 8"),
        (_mesh((1, 4), (8, 2), devices_per_process=4), 3, 8,
         r"config\.mesh\.devices_per_process=4: the run's processes have 8"),
    ]  # fmt: skip
    for mesh, n, dpp, message in cases:
        with pytest.raises(ClusterError, match=message):
            Roles.from_config(mesh, n, devices_per_process=dpp)


def test_a_replica_takes_whole_processes_and_the_trainer_its_processes():
    mesh = _mesh((12, 4), (8, 2))
    roles = Roles.from_config(mesh, 16, devices_per_process=4)  # derivable: 4 trainers, 12 in the replica
    assert roles.replicas == (tuple(range(4, 16)),) and roles.samplers == (4,)
    assert roles.role(4) == "sampler 0" and roles.role(15) == "sampler 0 member 11"
    check_placement(mesh, roles, 4)  # a replica that spans processes places
    listed = _mesh((12, 4), (8, 2), sampler_processes=(4,), trainer_processes=(0, 1, 2, 3))
    wide = (r"config\.mesh\.sampler=\(12, 4\): a 48-device replica needs 12 whole processes of 4 devices; "
            r"replica\(s\) \[\[4\]\] have \[1\]")  # fmt: skip
    with pytest.raises(ClusterError, match=wide):
        check_placement(listed, Roles.from_config(listed, 5), 4)
    with pytest.raises(ClusterError, match=r"a 6-device replica does not fill whole processes of 4"):
        check_placement(_mesh((6, 1), (4, 1)), roles, 4)
    explicit = _mesh((1, 1), (4, 1), sampler_processes=(1,), trainer_processes=(0,))
    short = r"config\.mesh\.trainer=\(4, 1\): needs 4 devices, the trainer processes \(0,\) have 2"
    with pytest.raises(ClusterError, match=short):
        check_placement(explicit, Roles.from_config(explicit, 2), 2)


def test_math_8b_tpu_layout_places_on_16_hosts_of_4_chips():
    c = math_8b.get_config()
    mesh = MeshConfig(**c.mesh.to_dict())
    roles = Roles.from_config(mesh, 16, devices_per_process=4)
    check_placement(mesh, roles, 4)
    assert roles.trainers == (0, 1, 2, 3) and roles.samplers == tuple(range(4, 16))
    with pytest.raises(ClusterError, match=r"sampler_replicas=12"):
        Roles.from_config(mesh, 8, devices_per_process=4)


def test_connect_refuses_a_layout_the_process_count_cannot_hold_before_connecting():
    """--num_processes alone (what the launchers pass; JAX finds the rest) is checked against the config
    before jax.distributed starts; a coordinator or id without the others is refused."""
    mesh = MeshConfig(**math_8b.get_config().mesh.to_dict())
    with pytest.raises(ClusterError, match=r"sampler_replicas=12: .* the run has 8"):
        connect(mesh, Flags.resolve(num_processes=8))
    with pytest.raises(ClusterError, match=r"needs --coordinator_address, --num_processes too"):
        connect(mesh, Flags.resolve(process_id=1))
