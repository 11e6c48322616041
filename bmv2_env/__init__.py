"""BMv2 test beds on this machine: namespaces, veth pairs, simple_switch_grpc, the pipeline, a job."""
