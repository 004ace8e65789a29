"""Expert parallelism as a layer around the single-device model: routed experts sharded over the
ranks of one engine instance (dispatch, combine, placement, EPLB). The processes that run the
ranks live in :mod:`libs.serving.ep`."""
