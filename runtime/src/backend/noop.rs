//! A backend that does nothing: every pass returns at once and every receive completes
//! immediately. It measures the interpreter's own cost per instruction (tables, batching,
//! timing) and lets a rank run alone, without peers.

use super::{Backend, BackendError, CommError, CommOp, Dir};
use pipec_schedules::Task;

#[derive(Default, Debug)]
pub struct NoopBackend;

impl Backend for NoopBackend {
    type Tensor = ();
    type Saved = ();
    type Partial = ();
    type Host = ();

    fn fwd(
        &mut self,
        _: Task,
        _: Option<()>,
        save: bool,
    ) -> Result<((), Option<()>), BackendError> {
        Ok(((), save.then_some(())))
    }

    fn bwd(&mut self, _: Task, _: (), _: Option<()>) -> Result<(), BackendError> {
        Ok(())
    }

    fn bwd_d(&mut self, _: Task, _: &(), _: Option<()>) -> Result<((), ()), BackendError> {
        Ok(((), ()))
    }

    fn bwd_w(&mut self, _: Task, _: (), _: ()) -> Result<(), BackendError> {
        Ok(())
    }

    fn keep(&mut self, _: &()) -> Result<(), BackendError> {
        Ok(())
    }

    fn offload(&mut self, _: Task, _: ()) -> Result<(), BackendError> {
        Ok(())
    }

    fn wait_offload(&mut self, _: Task) -> Result<(), BackendError> {
        Ok(())
    }

    fn reload(&mut self, _: Task, _: ()) -> Result<(), BackendError> {
        Ok(())
    }

    fn post(&mut self, _: &mut [CommOp<()>]) -> Result<(), CommError> {
        Ok(())
    }

    fn complete(&mut self, ops: &mut [CommOp<()>]) -> Result<(), CommError> {
        self.exchange(ops)
    }

    fn exchange(&mut self, ops: &mut [CommOp<()>]) -> Result<(), CommError> {
        for op in ops {
            op.tensor = match op.dir {
                Dir::Send => None,
                Dir::Recv => Some(()),
            };
        }
        Ok(())
    }
}
