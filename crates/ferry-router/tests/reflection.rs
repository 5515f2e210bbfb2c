//! gRPC server reflection on the router, in both protocol versions that clients ask (`v1`, and
//! `v1alpha`: Python's grpcio-reflection, older grpcurl, Postman, Evans): it lists the services the
//! router answers and no others, and serves the descriptor a client builds its calls from.

mod common;

use std::collections::BTreeSet;

use common::TestRouter;
use ferry_router::RouterConfig;

/// The services listed and the number of file descriptors that hold `ferry.v1.Ferry`, over one
/// reflection stream of protocol version `$v`.
macro_rules! ask {
    ($v:ident, $channel:expr) => {{
        use tonic_reflection::pb::$v::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$v::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$v::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::$v::ServerReflectionRequest;
        let mut client = ServerReflectionClient::new($channel);
        let req = |m| ServerReflectionRequest { host: String::new(), message_request: Some(m) };
        let asks = vec![req(MessageRequest::ListServices(String::new())), req(MessageRequest::FileContainingSymbol("ferry.v1.Ferry".into()))];
        let mut answers = client.server_reflection_info(tokio_stream::iter(asks)).await.expect("reflection answers").into_inner();
        let mut listed = BTreeSet::new();
        let mut files = 0;
        while let Some(r) = answers.message().await.expect("a reflection answer") {
            match r.message_response.expect("an answer") {
                MessageResponse::ListServicesResponse(l) => listed.extend(l.service.into_iter().map(|s| s.name)),
                MessageResponse::FileDescriptorResponse(f) => files += f.file_descriptor_proto.len(),
                other => panic!("unexpected answer: {other:?}"),
            }
        }
        (listed, files)
    }};
}

#[tokio::test]
async fn both_reflection_versions_list_only_the_routers_services() {
    let r = TestRouter::start(RouterConfig::new(common::model_path())).await;
    let ours: BTreeSet<String> = ["ferry.v1.Admin", "ferry.v1.Ferry", "ferry.v1.Registry"].map(String::from).into();
    let (listed, files) = ask!(v1, r.channel().await);
    assert_eq!(listed, ours, "v1");
    assert!(files > 0, "v1: no descriptor for ferry.v1.Ferry");
    let (listed, files) = ask!(v1alpha, r.channel().await);
    assert_eq!(listed, ours, "v1alpha");
    assert!(files > 0, "v1alpha: no descriptor for ferry.v1.Ferry");
}
