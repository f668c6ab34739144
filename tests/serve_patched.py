"""`grpo serve` with one seam, for tests/test_serve_record.py: right after its check of a flow run's
deployment record passes (flows.serve_runner.ServeRunner.check_record), the record is PATCHed with
the fields GRPO_TEST_PATCH_AFTER_CHECK gives (JSON), as a caller of the API could do in the moment
between that check and the start of the flow-run process. Run from the repository root as
`python -m tests.serve_patched ARGS...`, ARGS being grpo serve's."""

import json
import os
import sys

from prefect.client.schemas.actions import DeploymentUpdate

from flows import serve_runner
from flows.cli import main

_check = serve_runner.ServeRunner.check_record


async def check_then_patch(self, flow_run, served) -> None:
    await _check(self, flow_run, served)
    fields = json.loads(os.environ["GRPO_TEST_PATCH_AFTER_CHECK"])
    await self._client.update_deployment(flow_run.deployment_id, DeploymentUpdate(**fields))


serve_runner.ServeRunner.check_record = check_then_patch

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
