//! The worker-facing `Registry` service and the operators' `Admin` service, both thin layers over
//! [`crate::workers::registry::Registry`].

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1;
use tonic::{Request, Response, Status};

use crate::workers::registry::Registry;
use crate::RouterError;
use crate::wire::{role_from_wire, state_to_wire};

#[derive(Clone)]
pub struct RegistryService {
    pub registry: Arc<Registry>,
}

#[tonic::async_trait]
impl v1::registry_server::Registry for RegistryService {
    async fn register(
        &self,
        req: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        let r = self.registry.register(req.get_ref())?;
        crate::metrics::set_worker_gauges(&self.registry);
        Ok(Response::new(r))
    }

    async fn heartbeat(
        &self,
        req: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        let beat = self.registry.heartbeat(req.get_ref(), Instant::now())?;
        Ok(Response::new(v1::HeartbeatResponse {
            state: state_to_wire(beat.state) as i32,
            kv_resync: beat.kv_resync,
        }))
    }

    async fn deregister(
        &self,
        req: Request<v1::WorkerRef>,
    ) -> Result<Response<v1::DeregisterResponse>, Status> {
        self.registry.deregister(&req.get_ref().worker_id, &req.get_ref().grpc_addr);
        crate::metrics::set_worker_gauges(&self.registry);
        Ok(Response::new(v1::DeregisterResponse {}))
    }
}

#[derive(Clone)]
pub struct AdminService {
    pub registry: Arc<Registry>,
    pub scaler: Option<crate::ops::scale::Scaler>,
    /// How the scaler (`ferry up`'s) is dialed: with the router's TLS.
    pub dial: crate::workers::dial::DialOptions,
}

#[tonic::async_trait]
impl v1::admin_server::Admin for AdminService {
    async fn list_workers(
        &self,
        _: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersResponse>, Status> {
        Ok(Response::new(v1::ListWorkersResponse {
            workers: self.registry.list(),
        }))
    }

    async fn drain(&self, req: Request<v1::WorkerRef>) -> Result<Response<v1::WorkerInfo>, Status> {
        let info = self.registry.drain(&req.get_ref().worker_id)?;
        crate::metrics::set_worker_gauges(&self.registry);
        Ok(Response::new(info))
    }

    async fn undrain(
        &self,
        req: Request<v1::WorkerRef>,
    ) -> Result<Response<v1::WorkerInfo>, Status> {
        let info = self.registry.undrain(&req.get_ref().worker_id)?;
        crate::metrics::set_worker_gauges(&self.registry);
        Ok(Response::new(info))
    }

    async fn scale(
        &self,
        req: Request<v1::ScaleRequest>,
    ) -> Result<Response<v1::ScaleResponse>, Status> {
        let r = req.get_ref();
        let role = role_from_wire(r.role).ok_or_else(|| {
            RouterError::InvalidRequest("scale: the role is unspecified".into())
        })?;
        let resp = crate::ops::scale::scale(self.scaler.as_ref(), &self.dial, role, r.replicas).await?;
        Ok(Response::new(resp))
    }

    async fn remove(
        &self,
        req: Request<v1::WorkerRef>,
    ) -> Result<Response<v1::WorkerInfo>, Status> {
        let info = self.registry.remove(&req.get_ref().worker_id)?;
        crate::metrics::set_worker_gauges(&self.registry);
        Ok(Response::new(info))
    }
}
