//! A thread that owns a value (the reconciler and its datapath) and runs
//! jobs on it: netlink and BPF syscalls block (a dump can wait up to the
//! socket timeout), and must never stall the async runtime that serves
//! watches, metrics and health. The value is built on the thread and never
//! leaves it, so it need not be `Send`.
use std::{
    sync::mpsc,
    thread::{self, JoinHandle},
};
use tokio::sync::oneshot;

type Job<T> = Box<dyn FnOnce(&mut T) + Send>;

/// The worker thread is gone (its value panicked).
#[derive(Debug, thiserror::Error)]
#[error("the datapath thread is gone")]
pub struct WorkerGone;

pub struct Worker<T> {
    jobs: Option<mpsc::Sender<Job<T>>>,
    thread: Option<JoinHandle<()>>,
}

impl<T: 'static> Worker<T> {
    /// Starts the thread and builds its value there with `make`; returns
    /// once it is built (or with `make`'s error).
    pub fn spawn<E>(
        name: &str,
        make: impl FnOnce() -> Result<T, E> + Send + 'static,
    ) -> Result<Self, E>
    where
        E: From<std::io::Error> + Send + 'static,
    {
        let (jobs, queue) = mpsc::channel::<Job<T>>();
        let (built, outcome) = mpsc::sync_channel::<Result<(), E>>(1);
        let thread = thread::Builder::new().name(name.into()).spawn(move || {
            let mut value = match make() {
                Ok(v) => {
                    let _ = built.send(Ok(()));
                    v
                }
                Err(e) => {
                    let _ = built.send(Err(e));
                    return;
                }
            };
            // Ends when every sender is gone.
            for job in queue {
                job(&mut value);
            }
        })?;
        match outcome.recv() {
            Ok(Ok(())) => Ok(Worker {
                jobs: Some(jobs),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(std::io::Error::other("the datapath thread panicked while starting").into())
            }
        }
    }

    /// Runs `f` on the thread; waits without blocking the runtime.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut T) -> R + Send + 'static,
    ) -> Result<R, WorkerGone> {
        let (tx, rx) = oneshot::channel();
        let job: Job<T> = Box::new(move |value| {
            let _ = tx.send(f(value));
        });
        self.jobs
            .as_ref()
            .ok_or(WorkerGone)?
            .send(job)
            .map_err(|_| WorkerGone)?;
        rx.await.map_err(|_| WorkerGone)
    }
}

impl<T> Drop for Worker<T> {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the job in progress.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn jobs_run_on_the_thread_in_order_and_a_slow_one_does_not_block_the_runtime() {
        let worker: Worker<Vec<u32>> =
            Worker::spawn("test", || Ok::<_, std::io::Error>(Vec::new())).expect("spawn");
        let main_thread = thread::current().id();
        let slow = worker.call(move |v| {
            assert_ne!(thread::current().id(), main_thread);
            std::thread::sleep(std::time::Duration::from_millis(200));
            v.push(1);
        });
        // On a single-threaded runtime, a timer still fires while the
        // worker sleeps: the runtime is not blocked.
        let ticked = tokio::time::timeout(std::time::Duration::from_millis(50), async {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        });
        let (done, tick) = tokio::join!(slow, ticked);
        done.expect("worker");
        assert!(tick.is_ok(), "the runtime was blocked");
        worker.call(|v| v.push(2)).await.expect("worker");
        assert_eq!(
            worker.call(|v| v.clone()).await.expect("worker"),
            vec![1, 2]
        );
    }

    #[test]
    fn a_failing_constructor_is_returned() {
        let r: Result<Worker<()>, std::io::Error> =
            Worker::spawn("test", || Err(std::io::Error::other("no kernel")));
        assert!(r.is_err());
    }
}
