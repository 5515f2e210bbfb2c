//! What the router's services share ([`Shared`]): the registry, the admission queue, the model's
//! text side, the configuration. It sits at the bottom of the crate: it imports the parts it
//! holds, and nothing it holds imports it.

use std::sync::Arc;

use ferry_tokenizer::ModelText;

use crate::config::RouterConfig;
use crate::ops::window::Window;
use crate::pipeline::queue::AdmissionQueue;
use crate::workers::registry::Registry;

/// State shared by the router's services.
pub struct Shared {
    pub registry: Arc<Registry>,
    /// Requests waiting for room on a decode worker.
    pub queue: Arc<AdmissionQueue>,
    /// The model's tokenizer and chat template; `text.name` is the served name clients see.
    pub text: ModelText,
    pub cfg: RouterConfig,
    /// Structured outputs: grammars are compiled here first, so a bad one is refused before any
    /// worker sees it.
    pub grammars: ferry_grammar::LazyGrammars,
    /// What the autoscaler measures: arrivals and finished requests since it last looked.
    pub window: Window,
}

impl Shared {
    /// Every name the model is served under, the reported one first.
    pub fn model_names(&self) -> Vec<&str> {
        let mut names = vec![self.text.name.as_str()];
        names.extend(self.cfg.served_model_names.iter().skip(1).map(String::as_str));
        names
    }

    /// Whether a request's `model` names this router's model.
    pub fn serves(&self, model: &str) -> bool {
        self.model_names().contains(&model)
    }
}
